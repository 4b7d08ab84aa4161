"""``GradHome``: the part of ``amp8.tensor.stored.StoredWeight`` that is its weight's FP8
gradient home. The gradient lives in ``param.grad`` as a ``WeightGrad``, or on the handle
for a weight FSDP2 shards (``add_grad``); the grad-ready hooks run after each backward has
added to it, whichever of the two holds it."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp8.config.recipe import Recipe
from amp8.tensor import weight_grad
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad import COMPILED_SLOTS, GradLayout, GradSlot, WeightGrad
from amp8.tensor.weight_grad_ops import PLAIN_GRAD_FIX


@contextlib.contextmanager
def requiring_grad(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """``param`` with ``requires_grad`` on inside the block and as it was after it.

    torch refuses a grad hook on a frozen tensor and records no graph through one; what is
    built for a frozen weight this way stays, and serves if the weight is unfrozen later.
    """
    frozen = not param.requires_grad
    try:
        with torch.enable_grad():
            yield param.requires_grad_(True)
    finally:
        if frozen:
            param.requires_grad_(False)


class GradHome:
    """The weight gradient of ``StoredWeight`` (see its class docstring): where backward
    writes it, how it is stored, and the hooks that run once it is ready."""

    grad_slot: GradSlot | None = None
    """Where the layer's backward writes the weight's FP8 gradient: views of the gradient
    buffer of the optimizer step that reads it (``amp8.tensor.weight_grad.GradSlot``), or
    None (memory of its own)."""

    recipe: Recipe
    sharded: bool
    _held_grad: WeightGrad | None
    _grad_ready_hooks: OrderedDict[int, Callable[[nn.Parameter], None]]
    _hooked: nn.Parameter | None

    if TYPE_CHECKING:  # defined by StoredWeight
        @property
        def param(self) -> nn.Parameter: ...

    def backward_slot(self) -> GradSlot | None:
        """The slot the layer's backward is given: ``grad_slot``, but None inside a
        compiled graph unless compiled backwards take slots
        (``weight_grad.COMPILED_SLOT_MIN_ELEMENTS`` set, in a torch that can pass one
        through a graph, ``COMPILED_SLOTS``): the graph then holds no slot at all."""
        if torch.compiler.is_compiling() and (not COMPILED_SLOTS or weight_grad.COMPILED_SLOT_MIN_ELEMENTS is None):
            return None
        return self.grad_slot

    def _hook_grad_ready(self, param: nn.Parameter, again: bool = False) -> None:
        """Run the grad-ready hooks after each backward has accumulated into
        ``param.grad`` (registered ``again`` where the tensor was swapped whole)."""
        if self._hooked is not param or again:
            with requiring_grad(param):
                param.register_post_accumulate_grad_hook(functools.partial(_grad_accumulated, weakref.ref(self)))
            self._hooked = param

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 dtype of the weight gradient (``Recipe.weight_grad_format``)."""
        return self.recipe.weight_grad_dtype

    @property
    def grad_layout(self) -> GradLayout:
        """How the weight gradient is stored (``GradLayout.for_weight`` of the recipe)."""
        return GradLayout.for_weight(self.recipe, tuple(self.param.shape))

    def grad(self) -> ScaledTensor | None:
        """The weight gradient as FP8 + scales, or None. Like ``param.grad`` it is live:
        a later backward or clip changes it in place."""
        if self.sharded:
            return None if self._held_grad is None else self._held_grad.fp8
        param = self.param
        grad = param.grad
        if grad is None:
            return None
        if not isinstance(grad, WeightGrad):
            if not (type(grad) is torch.Tensor and grad.is_floating_point() and grad.shape == param.shape):
                raise TypeError(
                    f"the weight gradient of an FP8 layer must be an amp8 WeightGrad (FP8 + "
                    f"scale), found a {type(grad).__name__} of {grad.dtype}; {PLAIN_GRAD_FIX}"
                )
            # Model code that reads the weight itself (a product with ``layer.weight``)
            # gets its real gradient from autograd: stored in FP8 like the layer's own.
            self.set_grad_from_float(grad.float())
            grad = param.grad
        return grad.fp8

    def set_grad(self, value: ScaledTensor | None) -> None:
        """Replace the gradient (None clears it): ``value`` must have the gradient's FP8
        dtype, the weight's shape and the weight's scale layout."""
        if value is not None:
            self._check_grad(value)
        grad = None if value is None else WeightGrad(value, self.param.dtype, self.grad_layout)
        if self.sharded:
            self._held_grad = grad
        else:
            self.param.grad = grad

    def clear_grad(self) -> None:
        """Drop the gradient."""
        self.set_grad(None)

    def quantize_grad(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(FP8 data, scales)`` of a float weight gradient at ``grad_layout``: fresh
        scales per tile (what backward and accumulation use)."""
        fp8 = self.grad_layout.quantize(value)
        return fp8.data, fp8.scale

    def set_grad_from_float(self, value: torch.Tensor) -> None:
        """Store float ``value`` as the gradient, in FP8 with fresh scales."""
        self.set_grad(self.grad_layout.quantize(value))

    def add_grad(self, grad: WeightGrad) -> None:
        """A sharded weight's new gradient from backward (see ``shard``): it becomes the
        gradient the handle holds, or is added to it (gradient accumulation) and stored
        again with fresh scales. Then the grad-ready hooks run."""
        if self._held_grad is None:
            self._held_grad = grad.at_rest()
        else:
            self._held_grad.add_(grad)
        self.run_grad_ready_hooks()

    def register_grad_ready_hook(self, hook: Callable[[nn.Parameter], None]) -> RemovableHandle:
        """Call ``hook(param)`` after each backward has added to the gradient (the
        Parameter's post-accumulate-grad hook, or ``add_grad`` for a sharded weight)."""
        handle = RemovableHandle(self._grad_ready_hooks)
        self._grad_ready_hooks[handle.id] = hook
        return handle

    def run_grad_ready_hooks(self) -> None:
        """Run the hooks of ``register_grad_ready_hook``."""
        for hook in list(self._grad_ready_hooks.values()):
            hook(self.param)

    @property
    def grad_scale_shape(self) -> torch.Size:
        """The shape of the gradient's scales (one per tile of ``grad_layout``)."""
        return self.grad_layout.scale_shape(tuple(self.param.shape))

    def _check_grad(self, value: ScaledTensor) -> None:
        expected_scale = self.grad_scale_shape
        if value.dtype != self.grad_dtype or value.shape != self.param.shape or (
            value.scale.shape != expected_scale
        ):
            raise ValueError(
                f"a weight gradient of {value.dtype}, shape {tuple(value.shape)}, scales of shape "
                f"{tuple(value.scale.shape)} does not fit this weight: {self.grad_dtype}, shape "
                f"{tuple(self.param.shape)}, scales {tuple(expected_scale)}"
            )


def _grad_accumulated(handle: "weakref.ref[GradHome]", param: nn.Parameter) -> None:
    """The Parameter's post-accumulate-grad hook: its handle's grad-ready hooks run."""
    stored = handle()
    if stored is not None:
        stored.run_grad_ready_hooks()
