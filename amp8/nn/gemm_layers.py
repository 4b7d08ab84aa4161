"""Which modules hold a GEMM weight that amp8 can run as an ``Fp8Linear``: found by
structure and by what their forward computes, never by class name.

- ``nn.Linear`` and the subclasses that keep ``nn.Linear.forward``: Linear's math.
- A subclass that overrides ``forward`` (Falcon's ``FalconLinear``): Linear's math where
  a probe shows ``forward(x) == F.linear(x, weight, bias)``; one that scales its output
  or adds to it stays in high precision, with the reason.
- A ``Conv1D``-like module (GPT-2's ``transformers.pytorch_utils.Conv1D``): no child
  modules, a 2-D ``weight`` Parameter of shape (in, out), a ``bias`` of shape (out,) or
  None, an int ``nf`` equal to out, and a forward that a probe shows to be ``x @ W + b``.
- ``nn.MultiheadAttention``'s ``out_proj`` stays in high precision: the attention passes
  ``out_proj.weight`` to ``F.multi_head_attention_forward`` and never calls the layer.

The probe runs once per module, at ``initialize``: its forward (the class's, without the
module's hooks) on a deep copy whose Parameters are random (a fixed seed, the module's
shapes, dtype and device) and on a 3-token random input, under ``torch.no_grad`` and with
the global random state restored afterwards. Per module, not per class, because a
subclass's math can hang on per-instance attributes (a LoRA-style ``scaling``); on a copy
with random values, because the real weights can hide a difference (a zero-initialized
projection gives zeros whatever the forward does) and because the forward may write to
its module (counters, caches). It costs one weight-sized random tensor per probed module,
and only subclasses that override ``forward`` and ``Conv1D``-like modules are probed.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

PROBE_TOKENS = 3
"""Rows of the probe's input."""

PROBE_SEED = 0
"""Seed of the probe's random weights and input (its own generator: the model's random
state is left as it was)."""


class GemmKind(str, Enum):
    """How a GEMM layer's weight Parameter is laid out.

    LINEAR: (out, in), ``y = x W^T + b`` (``Fp8Linear.from_linear``).
    TRANSPOSED: (in, out), ``y = x W + b``, a ``Conv1D`` (``Fp8Linear.from_conv1d``).
    """

    LINEAR = "linear"
    TRANSPOSED = "transposed"


def gemm_kind(module: nn.Module) -> GemmKind | None:
    """The layout of ``module``'s GEMM weight, found by structure alone (no probe), or
    None for a module that holds no GEMM weight amp8 knows (see the module docstring)."""
    if isinstance(module, nn.Linear):
        return GemmKind.LINEAR
    return GemmKind.TRANSPOSED if _conv1d_like(module) else None


def _conv1d_like(module: nn.Module) -> bool:
    """A module shaped like GPT-2's ``Conv1D``: no children, Parameters ``weight`` (2-D,
    (in, out)) and ``bias`` ((out,) or None) alone, and an int ``nf`` equal to out."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or next(module.children(), None) is not None:
        return False
    bias = getattr(module, "bias", None)
    names = {name for name, _ in module.named_parameters(recurse=False)}
    nf = getattr(module, "nf", None)
    return (
        isinstance(nf, int) and not isinstance(nf, bool) and nf == weight.shape[1]
        and names <= {"weight", "bias"}
        and (bias is None or (isinstance(bias, torch.Tensor) and tuple(bias.shape) == (nf,)))
    )


def gemm_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a module ``gemm_kind`` knows, from its weight's shape."""
    rows, columns = module.weight.shape  # type: ignore[union-attr]
    return (columns, rows) if gemm_kind(module) is GemmKind.LINEAR else (rows, columns)


def attention_out_projections(model: nn.Module) -> dict[int, str]:
    """``{id(out_proj): why it stays in high precision}`` for every ``nn.MultiheadAttention``
    in ``model``: the attention reads ``out_proj.weight`` itself, so an FP8 layer in its
    place would never run (and its re-stored weight would be read as the real one)."""
    return {
        id(module.out_proj): (
            "out_proj of nn.MultiheadAttention, which passes out_proj.weight to "
            "F.multi_head_attention_forward and never calls the layer: an FP8 layer there would not run"
        )
        for module in model.modules() if isinstance(module, nn.MultiheadAttention)
    }


def math_reason(module: nn.Module) -> str | None:
    """Why ``module`` (one ``gemm_kind`` knows) does not compute the math its kind runs
    as in FP8, or None where it does: ``nn.Linear`` and subclasses that keep its forward
    at once, others by a probe (see the module docstring). A subclass that holds other
    Parameters or submodules (a LoRA-style layer with its own ``lora_A``, ``lora_B``)
    stays too: the FP8 layer would drop them."""
    kind = gemm_kind(module)
    name = type(module).__name__
    if kind is GemmKind.LINEAR and type(module) is not nn.Linear:
        others = [n for n, _ in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
        others += [n for n, _ in module.named_children()]
        if others:
            return (
                f"{name} (an nn.Linear subclass) holds other Parameters or submodules ({', '.join(others)}) "
                "that an FP8 layer in its place would drop; amp8 runs Linear's math alone in FP8"
            )
    if kind is GemmKind.LINEAR and type(module).forward is nn.Linear.forward:
        return None
    if kind is GemmKind.LINEAR:
        what, reference = "F.linear(x, weight, bias)", _linear_math
        prefix = f"{name} (an nn.Linear subclass) overrides forward"
    else:
        what, reference = "x @ weight + bias", _transposed_math
        prefix = f"{name} (Conv1D-like: weight (in, out))"
    found = _probe(module, reference)
    if found is None:
        return None
    return f"{prefix} and a probe found it computes other math than {what} ({found}); amp8 runs that math alone in FP8"


def _linear_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _transposed_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ weight
    return y if bias is None else y + bias


def _probe(
    module: nn.Module, reference: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
) -> str | None:
    """What differs between ``module``'s forward and ``reference(x, weight, bias)`` on a
    copy with random Parameters and a random input (see the module docstring), or None."""
    weight, bias = module.weight, getattr(module, "bias", None)
    if weight.device.type == "meta" or not weight.dtype.is_floating_point:
        return f"its weight ({weight.dtype} on {weight.device.type}) holds no values to probe with"
    generator = torch.Generator(device=weight.device).manual_seed(PROBE_SEED)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=weight.device).to(weight.dtype)

    in_features = gemm_features(module)[0]
    random_weight = nn.Parameter(randn(*weight.shape), requires_grad=False)
    random_bias = None if bias is None else nn.Parameter(randn(*bias.shape), requires_grad=False)
    memo = {id(weight): random_weight, **({} if bias is None else {id(bias): random_bias})}
    stand_in = copy.deepcopy(module, memo)
    x = randn(PROBE_TOKENS, in_features)
    devices = [weight.device] if weight.device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            got = type(stand_in).forward(stand_in, x)  # the class's math, without the module's hooks
    except Exception as error:  # any failure means amp8 cannot vouch for the math
        return f"its forward failed on a ({PROBE_TOKENS}, {in_features}) input: {type(error).__name__}"
    expected = reference(x.float(), random_weight.float(), None if random_bias is None else random_bias.float())
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"output {shape} where {tuple(expected.shape)} was expected"
    tolerance = max(1e-4, 8 * torch.finfo(weight.dtype).eps)
    error = float((got.float() - expected).norm() / expected.norm().clamp(min=1e-30))
    return None if error <= tolerance else f"relative difference {error:.2g}"
