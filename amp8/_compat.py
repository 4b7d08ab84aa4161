"""Which features this torch has: the one place in amp8 that reads torch's version or
probes torch for a feature.

amp8 supports torch ``OLDEST_TORCH`` through ``NEWEST_TORCH`` (the range ``pyproject.toml``
declares and the tests run on). A feature amp8 uses that some of those releases lack is a
``TorchFeature`` below, with the first release that has it; the rest of amp8 asks this
module (``native_rowwise_scaled_mm``, ``COMPILED_SHARDED_LAYERS.available()``,
``fsdp_module_types``) and never compares versions or probes torch itself.

In every supported release, so not listed: the FP8 dtypes ``float8_e4m3fn`` and
``float8_e5m2``, the microscaling dtypes ``float8_e8m0fnu`` and ``float4_e2m1fn_x2``,
tensorwise ``torch._scaled_mm`` on the CPU, tensorwise, rowwise and block-scaled
``torch._scaled_mm`` on CUDA, rowwise ``torch._scaled_grouped_mm`` on CUDA (sm_90 and
sm_100: ``native_grouped_scaled_mm``), and FSDP2's public API (``torch.distributed.fsdp``'s
``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy`` and the
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` extension of tensor subclasses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

OLDEST_TORCH: tuple[int, int] = (2, 11)
"""The oldest torch release amp8 supports and tests."""
NEWEST_TORCH: tuple[int, int] = (2, 15)
"""The newest torch release amp8 supports and tests."""


def parse_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``: a torch version string's major and minor release.

    Raises:
        ValueError: ``version`` does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from the version {version!r}; expected 'MAJOR.MINOR...'")
    return int(match.group(1)), int(match.group(2))


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor) release."""
    return parse_version(str(torch.__version__))


def version_name(version: tuple[int, int]) -> str:
    """``(2, 13)`` -> ``"2.13"``."""
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class TorchFeature:
    """A torch feature amp8 uses that arrived within the supported range.

    Attributes:
        name: what the feature is, as error messages and docs name it.
        since: the first torch release that has it.
    """

    name: str
    since: tuple[int, int]

    def available(self, version: tuple[int, int] | None = None) -> bool:
        """Whether torch ``version`` (default: the installed one) has this feature."""
        return (torch_version() if version is None else version) >= self.since

    def missing_reason(self, version: tuple[int, int] | None = None) -> str | None:
        """Why torch ``version`` (default: the installed one) lacks this feature, naming
        the release that brings it; None where it has it."""
        version = torch_version() if version is None else version
        if self.available(version):
            return None
        return f"torch {version_name(version)} lacks {self.name}; torch {version_name(self.since)} or newer has it"


CPU_ROWWISE_SCALED_MM = TorchFeature("row-wise scales in torch._scaled_mm on the CPU", (2, 12))
"""``torch._scaled_mm`` with (M, 1) and (1, N) scales on the CPU (CUDA has them in every
supported release). Without it ``amp8.ops.gemm`` emulates the call exactly: dequantize each
operand to float32 with its scales, one float32 matmul, one rounding to the output dtype,
which is what the CPU kernel computes."""

COMPILED_SHARDED_LAYERS = TorchFeature("torch.compile of FP8 layers that FSDP2 shards (O3 in data parallel)", (2, 12))
"""Dynamo tracing an FP8 layer's autograd.Function inside a module that ``fully_shard``
wraps. torch 2.11's Dynamo fails an internal assert there (in
``overwrite_tensor_vt_proxy``); without the feature a sharded ``Fp8Linear`` runs its
forward outside the compiled graphs (``torch.compiler.disable``), and the rest of the
model compiles."""

DYNAMIC_SHAPE_LAYERS = TorchFeature("torch.compile(model, dynamic=True) of FP8 layers", (2, 13))
"""Dynamo tracing an FP8 layer's autograd.Function with every size symbolic
(``dynamic=True``), when a new sequence length makes it compile again. torch 2.11's Dynamo
fails the internal assert of ``COMPILED_SHARDED_LAYERS`` there for most recipes; 2.12 is
untried. The default ``torch.compile(model)`` marks sizes dynamic only once they change,
and works on every supported torch."""

FEATURES: tuple[TorchFeature, ...] = (CPU_ROWWISE_SCALED_MM, COMPILED_SHARDED_LAYERS, DYNAMIC_SHAPE_LAYERS)
"""Every feature in this module."""


try:  # a private API, in every release amp8 tests (2.11, 2.13); probed, so a torch without it runs amp8
    from torch._library.opaque_object import register_opaque_type as _register_opaque_type
    from torch._opaque_base import OpaqueBase as OpaqueReferenceBase
except ImportError:
    _register_opaque_type = None
    OpaqueReferenceBase = object  # type: ignore[assignment,misc]
"""The base class of a Python object that torch.compile passes to a custom operator as it
is, by reference, without looking into it (``register_opaque_reference``); ``object`` in a
torch without opaque objects."""


def register_opaque_reference(cls: type) -> bool:
    """Register ``cls`` (a subclass of ``OpaqueReferenceBase``) as an opaque reference type:
    custom operators take its objects and torch.compile passes them through its graphs
    unopened. False, with nothing done, in a torch without opaque objects."""
    if _register_opaque_type is None:
        return False
    _register_opaque_type(cls, typ="reference")
    return True


try:  # a private API, in every release amp8 tests (2.11, 2.13); probed, so a torch without it runs amp8
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:
    _eval_frame_callback = None


def inside_compiled_call() -> bool:
    """Whether code runs inside a call of a ``torch.compile`` wrapper, traced or run
    eagerly between its graphs (where ``torch.compiler.is_compiling()`` is False, but the
    frames it calls are compiled); False in a torch without the probe."""
    if torch.compiler.is_compiling():
        return True
    return _eval_frame_callback is not None and _eval_frame_callback() not in (None, False)


def running_backward() -> bool:
    """Whether code runs inside autograd's backward: where activation checkpointing runs
    a forward again (``torch.utils.checkpoint``, reentrant or not). False while
    ``torch.compile`` traces (a compiled graph recomputes without running Python)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def fsdp_module_types() -> tuple[type, ...]:
    """``(FSDPModule,)``, the class FSDP2's ``fully_shard`` gives the modules it wraps; empty
    in a torch built without distributed support, where nothing can be wrapped."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule

    return (FSDPModule,)


_GROUPED_SCALED_MM_CAPABILITIES = ((9, 0), (10, 0))  # the GPUs torch builds its rowwise grouped FP8 kernel for


def native_grouped_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs FP8 operands with rowwise scales on
    ``device``: CUDA GPUs of compute capability 9.0 or 10.0 (torch has no CPU kernel)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) in _GROUPED_SCALED_MM_CAPABILITIES


def native_rowwise_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes rowwise scales on ``device`` with this torch."""
    return device.type != "cpu" or CPU_ROWWISE_SCALED_MM.available()
