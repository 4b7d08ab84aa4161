"""FP8 storage of the tensors autograd saves for backward (``Recipe(activations="fp8")``).

``attach_activation_storage(model, policy)`` registers a forward pre-hook and a forward
hook on ``model``: between them, ``torch.autograd.graph.saved_tensors_hooks`` stores
every saved tensor the policy accepts as E4M3 with one float32 scale per ``1 x
group_size`` tile along its last dimension, and backward gets it back in its own dtype
and shape. Nothing outside the model's forward is touched, and no function of torch is
replaced. The policy keeps as they are: tensors that are not floating point (indices,
dropout masks), already one byte per element (FP8 layers' inputs), small, narrow in
their last dimension, not requiring grad (statistics such as attention's log-sum-exp
and norms' mean and reciprocal deviation, which backward exponentiates or divides by,
and inputs), views of the model's parameters and buffers
and copies of parameters (autocast's BF16 weights, see ``amp8.nn.memory``), and the outputs of the operations it names (log-softmax: an absolute error in log space
is a relative error of the probabilities).

Autograd does not check the version of a tensor that saved-tensor hooks pack, so the
storage checks it itself where backward would read changed values: a tensor kept as it
is (or still held elsewhere) that was changed in place after it was saved raises
autograd's own error. An FP8 copy keeps the values the tensor had when it was saved.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp8 import _compat
from amp8.config.formats import E4M3
from amp8.nn.hooks import remove_forward_hooks
from amp8.nn.memory import (
    STORAGE_ATTRIBUTE, SavedBytes, StorageKey, is_parameter_copy, persistent_storages, storage_key,
)
from amp8.quant.scaling import expand_scale, quantize_tiles

@dataclass(frozen=True)
class ActivationPolicy:
    """Which saved tensors go to FP8, and how.

    Attributes:
        dtype: the FP8 dtype of stored activations.
        group_size: elements along the last dimension sharing one scale.
        min_numel: smaller tensors stay as they are (their scales would cost more than
            they save, and they are few).
        min_last_dim: tensors with a narrower last dimension stay as they are (norm
            statistics of shape (..., 1), which backward divides by).
        power_of_2_scales: round scales down to powers of two.
        log_space_outputs_of: names of autograd nodes whose saved outputs are
            log-probabilities: they are stored as FP8 probabilities (``exp``) and restored
            with ``log``, so the probabilities backward reads keep FP8's relative error
            (an absolute error in log space would be a relative error of every
            probability).
    """

    dtype: torch.dtype = E4M3
    group_size: int = 128
    min_numel: int = 1024
    min_last_dim: int = 16
    power_of_2_scales: bool = False
    log_space_outputs_of: frozenset[str] = frozenset({"LogSoftmaxBackward0"})

    def tile(self, last_dim: int) -> tuple[int, int]:
        """The (rows, columns) tile sharing one scale in a tensor seen as (-1, last_dim)."""
        return (1, min(self.group_size, last_dim))

    def compresses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (not a parameter's storage; checked by the caller) goes to
        FP8: a floating-point activation of more than one byte per element, on the
        differentiable path (a saved tensor that does not require grad is a statistic,
        such as attention's log-sum-exp or a norm's mean, or an input), large enough."""
        if not tensor.is_floating_point() or tensor.element_size() == 1 or tensor.dim() == 0:
            return False
        if not tensor.requires_grad:
            return False
        return tensor.numel() >= self.min_numel and tensor.shape[-1] >= self.min_last_dim

    def in_log_space(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the saved output of a node named in
        ``log_space_outputs_of``."""
        node = tensor.grad_fn
        return node is not None and type(node).__name__ in self.log_space_outputs_of


@dataclass(frozen=True)
class Fp8Saved:
    """A saved tensor stored in FP8: ``data`` (rows, last dim) and its tile scales;
    ``log_space``: the data holds ``exp`` of the tensor."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int
    log_space: bool = False

    def restore(self) -> torch.Tensor:
        """The tensor's values in its own dtype and shape."""
        full = expand_scale(self.scale, tuple(self.data.shape), self.block_size)
        values = self.data.float() / full
        if self.log_space:
            values = values.log_()
        return values.to(self.dtype).view(self.shape)


@dataclass(frozen=True)
class SavedVersion:
    """What autograd keeps of one saved tensor: ``value`` (the tensor, or its
    ``Fp8Saved`` copy) and the version ``source`` (held weakly: an FP8 copy does not
    keep the tensor) had when it was saved."""

    value: torch.Tensor | Fp8Saved
    source: weakref.ref[torch.Tensor]
    version: int

    def check(self) -> None:
        """Raise autograd's ``RuntimeError`` where the tensor, if still alive, was changed
        in place after it was saved (autograd's own check, which saved-tensor hooks
        bypass)."""
        source = self.source()
        if source is not None and source._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {source.dtype} tensor of shape {tuple(source.shape)} saved for "
                f"backward is at version {source._version}; expected version {self.version} instead. "
                "Change a copy instead (amp8 stores saved tensors through saved-tensor hooks, "
                "Recipe(activations='fp8'), and checks their versions as autograd does)"
            )


@dataclass
class ActivationStorage:
    """The hook pair that stores ``model``'s saved tensors in FP8 during its forward.

    ``meters`` are the ``SavedBytes`` of active ``amp8.nn.memory.count_saved_bytes`` blocks:
    the tensors this storage keeps (FP8 data and scales, or the tensor as it is) are
    counted there.
    """

    policy: ActivationPolicy
    meters: list[SavedBytes] = field(default_factory=list)
    _persistent: frozenset[StorageKey] = frozenset()
    _active: list[contextlib.AbstractContextManager[Any]] = field(default_factory=list)
    _packed: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Fp8Saved]] = field(default_factory=dict)

    def save(self, tensor: torch.Tensor) -> SavedVersion:
        """The pack hook: ``pack(tensor)`` with the version ``tensor`` has now."""
        return SavedVersion(self.pack(tensor), weakref.ref(tensor), tensor._version)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | Fp8Saved:
        """What autograd keeps of ``tensor``: an ``Fp8Saved`` copy or the tensor itself."""
        if (
            storage_key(tensor) in self._persistent
            or not self.policy.compresses(tensor)
            or is_parameter_copy(tensor, self._persistent)
        ):
            for meter in self.meters:
                meter.add(tensor)
            return tensor
        # One FP8 copy of a tensor several operations save (log-softmax's output, which
        # the loss saves too); the version tells an in-place change apart, and the weak
        # reference a new tensor at a freed address (the storage itself is not kept).
        view = (storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor._version)
        earlier = self._packed.get(view)
        if earlier is not None and earlier[0]() is tensor:
            self._count(earlier[1])
            return earlier[1]
        rows = tensor.detach().reshape(-1, tensor.shape[-1])  # (M, C)
        log_space = self.policy.in_log_space(tensor)
        if log_space:
            rows = rows.float().exp()
        tile = self.policy.tile(rows.shape[1])
        data, scale = quantize_tiles(rows, self.policy.dtype, tile, power_of_2=self.policy.power_of_2_scales)
        packed = Fp8Saved(data, scale, tensor.shape, tensor.dtype, max(tile), log_space)
        self._packed[view] = (weakref.ref(tensor), packed)
        self._count(packed)
        return packed

    def _count(self, packed: Fp8Saved) -> None:
        """Report the FP8 data and scales of ``packed`` to the meters (each storage once)."""
        for meter in self.meters:
            meter.add(packed.data)
            meter.add(packed.scale)

    @staticmethod
    def unpack(packed: SavedVersion | torch.Tensor | Fp8Saved) -> torch.Tensor:
        """The unpack hook: the saved tensor backward reads, from ``save`` (whose version
        is checked, see ``SavedVersion.check``) or ``pack``."""
        if isinstance(packed, SavedVersion):
            packed.check()
            packed = packed.value
        return packed if isinstance(packed, torch.Tensor) else packed.restore()

    def before_forward(self, model: nn.Module, args: Any) -> None:
        """Forward pre-hook: store what the forward saves from here on.

        Raises:
            RuntimeError: the model, or a module inside it, runs under ``torch.compile``
                (``module.compile()``, or a ``torch.compile`` wrapper's call).
        """
        if _compat.inside_compiled_call() or any(_is_compiled(module) for module in model.modules()):
            raise RuntimeError(
                "Recipe(activations='fp8') stores saved tensors through autograd's saved-tensor "
                "hooks, and a torch.compile'd region saves its tensors itself, in high precision "
                "(the GPT 'tiny' preset: 2820 bytes per token eagerly, 8394 compiled); run the "
                "model eagerly, or compile it with activations='high' (the default)"
            )
        self._persistent = persistent_storages(model)
        hooks = torch.autograd.graph.saved_tensors_hooks(self.save, self.unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def after_forward(self, model: nn.Module, args: Any, output: Any) -> None:
        """Forward hook (also called when the forward raises): stop storing."""
        if self._active:
            self._active.pop().__exit__(None, None, None)
        if not self._active:
            self._packed = {}


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (``torch.compile(module)``
    returns a wrapper instead, whose forward runs under ``is_compiling``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def attach_activation_storage(model: nn.Module, policy: ActivationPolicy | None = None) -> ActivationStorage:
    """Store the tensors ``model``'s forward saves for backward in FP8 (see the module
    docstring); returns the storage, which ``attached_storage(model)`` also finds.

    Raises:
        ValueError: ``model`` has an activation storage already.
    """
    if attached_storage(model) is not None:
        raise ValueError("model already stores its activations in FP8; attach the storage once")
    storage = ActivationStorage(policy or ActivationPolicy())
    model.register_forward_pre_hook(storage.before_forward)
    model.register_forward_hook(storage.after_forward, always_call=True)
    setattr(model, STORAGE_ATTRIBUTE, storage)
    return storage


def detach_activation_storage(module: nn.Module) -> None:
    """Undo ``attach_activation_storage`` on ``module`` (a copy of an attached model
    included): its forwards save tensors as torch does again."""
    storage = attached_storage(module)
    if storage is None:
        return
    remove_forward_hooks(module, lambda owner: owner is storage)
    delattr(module, STORAGE_ATTRIBUTE)


def attached_storage(module: nn.Module) -> ActivationStorage | None:
    """The ``ActivationStorage`` attached to ``module`` itself, or None."""
    storage = module.__dict__.get(STORAGE_ATTRIBUTE)
    return storage if isinstance(storage, ActivationStorage) else None
