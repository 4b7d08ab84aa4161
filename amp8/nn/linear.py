"""``Fp8Linear``: ``y = x W^T + b`` with all three GEMMs in FP8.

The layer reuses the caller's ``weight`` and ``bias`` Parameters. The weight's data is
stored as FP16 (O1, O2) or FP8 (O3) holding ``w * weight_scale``; ``weight_scale`` is a
buffer beside it. The weight gradient never goes to ``weight.grad``: the backward pass
stores it in ``layer.weight_grad`` as a ``ScaledTensor`` (FP8 data + float32 scale), where
the amp8 optimizer and gradient reduction read it. See DESIGN.md, "Weight gradients".
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from enum import IntEnum
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import scaling
from ..formats import E4M3, forward_dtype, gradient_dtype
from ..gemm import GemmRole, fp8_mm
from ..levels import Precision
from ..recipe import Recipe, Scaling
from ..tensor import ScaledTensor

_WEIGHT_STORAGE_DTYPES = {Precision.FP16: torch.float16, Precision.FP8: E4M3}
# Headroom of one binade above the FP16 weight's amax, so growth between rescales fits.
_FP16_WEIGHT_MARGIN = 1
_GEMM_ALIGNMENT = 16


class Slot(IntEnum):
    """Rows of a layer's ``scale`` and ``amax_history`` buffers."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


def _check_weight_storage(weight_storage: Precision) -> None:
    if weight_storage not in _WEIGHT_STORAGE_DTYPES:
        raise ValueError(
            f"weight_storage={weight_storage!r} is not valid; use one of "
            f"{[p.value for p in _WEIGHT_STORAGE_DTYPES]}"
        )


def _pad_rows(x8: torch.Tensor, multiple: int) -> torch.Tensor:
    """Append zero rows to an FP8 matrix so its row count is a multiple of ``multiple``."""
    missing = -x8.shape[0] % multiple
    if missing == 0:
        return x8
    zeros = torch.zeros(missing, x8.shape[1], dtype=torch.uint8, device=x8.device)
    return torch.cat([x8.view(torch.uint8), zeros]).view(x8.dtype)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (a transposed contiguous copy, transposed)."""
    return x.t().contiguous().t()


class Fp8Linear(nn.Module):
    """A linear layer whose forward, input-gradient and weight-gradient GEMMs run in FP8.

    Build one with ``Fp8Linear.from_linear(linear, recipe, weight_storage)``; it takes
    over the ``nn.Linear``'s Parameter objects, so an optimizer that holds them still
    points at the right tensors.

    Buffers (saved in ``state_dict``):
        weight_scale: float32 scalar, ``weight.data == w * weight_scale``.
        scale: (3,) float32, the FP8 scale last used for input, weight, grad_output.
        amax_history: (3, L) float32, newest first; L is 1 under current scaling.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        recipe: Recipe,
        weight_storage: Precision = Precision.FP16,
    ) -> None:
        super().__init__()
        _check_weight_storage(weight_storage)
        self.out_features, self.in_features = weight.shape
        self.recipe = recipe
        self.weight_storage = weight_storage
        device = weight.device
        self.register_buffer("weight_scale", torch.ones((), device=device))
        self.register_buffer("scale", torch.ones(len(Slot), device=device))
        self.register_buffer("amax_history", torch.zeros(len(Slot), recipe.history_len, device=device))
        real_weight = weight.detach().float()
        self.weight = weight
        self.bias = bias
        self.weight_grad: ScaledTensor | None = None
        # An OrderedDict: RemovableHandle keeps a weak reference to it.
        self._weight_grad_hooks: OrderedDict[int, Callable[[nn.Parameter], None]] = OrderedDict()
        self.write_weight(real_weight)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, weight_storage: Precision = Precision.FP16
    ) -> "Fp8Linear":
        """Swap-in for ``linear`` that reuses its Parameters (their data is re-stored)."""
        layer = cls(linear.weight, linear.bias, recipe, weight_storage)
        layer.train(linear.training)
        return layer

    # -- weight storage --------------------------------------------------------------
    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weight is stored in (float16 or float8_e4m3fn)."""
        return _WEIGHT_STORAGE_DTYPES[self.weight_storage]

    def read_weight(self) -> torch.Tensor:
        """The weight's real values in float32."""
        return scaling.dequantize(self.weight.detach(), self.weight_scale)

    def encode_weight(
        self,
        real_weight: torch.Tensor,
        generator: torch.Generator | None = None,
        amax_value: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` that store ``real_weight`` in this layer's weight dtype.

        FP16 storage takes a power-of-two scale (with one binade of headroom), rounded
        stochastically when a ``generator`` is given; FP8 storage takes the recipe's
        weight scale, and that scale feeds the GEMMs directly. ``amax_value`` replaces the
        amax of ``real_weight`` (to encode one chunk of a weight sharded over ranks).
        """
        dtype = self.weight_dtype
        if self.weight_storage is Precision.FP8:
            margin, power_of_2 = self.recipe.margin, self.recipe.power_of_2_scales
        else:
            margin, power_of_2 = _FP16_WEIGHT_MARGIN, True
        if amax_value is None:
            amax_value = scaling.amax(real_weight)
        scale = scaling.scale_from_amax(
            amax_value, dtype, margin=margin, power_of_2=power_of_2, previous=self.weight_scale
        )
        if generator is not None and self.weight_storage is Precision.FP16:
            return scaling.quantize_stochastic(real_weight, scale, dtype, generator), scale
        return scaling.quantize(real_weight, scale, dtype), scale

    def write_weight(self, real_weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Store ``real_weight`` (any float dtype) into the weight Parameter, in place
        (see ``encode_weight``)."""
        data, scale = self.encode_weight(real_weight, generator)
        with torch.no_grad():
            if self.weight.dtype == data.dtype:
                self.weight.copy_(data)
            else:
                self.weight.data = data
            self.weight_scale.copy_(scale)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (another opt level, or a
        plain ``nn.Linear``) and filling scale buffers such a checkpoint lacks."""
        weight_key, scale_key = prefix + "weight", prefix + "weight_scale"
        saved = state_dict.get(weight_key)
        if saved is not None and (saved.dtype != self.weight.dtype or scale_key not in state_dict):
            saved_scale = state_dict.get(scale_key, torch.ones((), device=saved.device))
            real = scaling.dequantize(saved, saved_scale.to(saved.device))
            state_dict[weight_key], state_dict[scale_key] = self.encode_weight(real.to(self.weight.device))
            warnings.warn(
                f"amp8: converted {weight_key} from {saved.dtype} to {self.weight_dtype} storage",
                stacklevel=2,
            )
        for key, buffer in ((prefix + "scale", self.scale), (prefix + "amax_history", self.amax_history)):
            saved_buffer = state_dict.get(key)
            if saved_buffer is None:
                state_dict[key] = buffer.clone()
            elif saved_buffer.shape != buffer.shape:  # another amax_history_len
                resized = torch.zeros_like(buffer)
                length = min(saved_buffer.shape[-1], buffer.shape[-1])
                resized[..., :length] = saved_buffer[..., :length]
                state_dict[key] = resized
        super()._load_from_state_dict(state_dict, prefix, *args)

    def set_weight_storage(self, weight_storage: Precision) -> None:
        """Re-store the weight as FP16 or FP8 (O3 keeps FP8 weights beside FP16 masters)."""
        _check_weight_storage(weight_storage)
        real_weight = self.read_weight()
        self.weight_storage = weight_storage
        self.write_weight(real_weight)

    # -- FP8 scales ------------------------------------------------------------------
    def fp8_dtype(self, slot: Slot) -> torch.dtype:
        """The FP8 dtype the tensor in ``slot`` is cast to for a GEMM."""
        fmt = self.recipe.fp8_format
        return gradient_dtype(fmt) if slot is Slot.GRAD_OUTPUT else forward_dtype(fmt)

    def next_scale(self, slot: Slot, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` the next cast of ``x`` in ``slot`` would use; changes nothing.

        Current scaling takes the scale from ``amax(x)``. Delayed scaling takes it from the
        amax history, falling back to ``amax(x)`` while the history is still empty. No
        scaling always gives 1.
        """
        recipe = self.recipe
        dtype = self.fp8_dtype(slot)
        current_amax = scaling.amax(x)
        if recipe.scaling is Scaling.NONE:
            return torch.ones_like(current_amax), current_amax
        previous = self.scale[slot]
        fresh = scaling.scale_from_amax(
            current_amax, dtype, margin=recipe.margin, power_of_2=recipe.power_of_2_scales,
            previous=previous,
        )
        if recipe.scaling is Scaling.CURRENT:
            return fresh, current_amax
        history = self.amax_history[slot]
        delayed = scaling.scale_from_amax(
            scaling.history_amax(history, recipe.amax_compute_algo), dtype,
            margin=recipe.margin, power_of_2=recipe.power_of_2_scales, previous=previous,
        )
        return torch.where(history.amax() > 0, delayed, fresh), current_amax

    def cast(self, slot: Slot, x: torch.Tensor) -> ScaledTensor:
        """Cast ``x`` to FP8 for ``slot``, recording the scale and (in training) the amax."""
        scale, current_amax = self.next_scale(slot, x)
        with torch.no_grad():
            self.scale[slot] = scale
            if self.training:
                finite_amax = torch.where(torch.isfinite(current_amax), current_amax, 0.0)
                self.amax_history[slot] = scaling.push_history(self.amax_history[slot], finite_amax)
        return ScaledTensor(scaling.quantize(x, scale, self.fp8_dtype(slot)), scale)

    def fp8_weight(self) -> ScaledTensor:
        """The weight as the FP8 GEMMs get it: stored FP8 at O3, else a fresh cast."""
        if self.weight_storage is Precision.FP8:
            return ScaledTensor(self.weight.detach(), self.weight_scale)
        return self.cast(Slot.WEIGHT, self.read_weight())

    # -- weight gradient -------------------------------------------------------------
    def accumulate_weight_grad(self, grad: torch.Tensor, run_hooks: bool = True) -> None:
        """Add a float32 weight gradient to ``weight_grad``, re-stored as FP8 + scale, then
        call the weight-gradient hooks (unless ``run_hooks`` is False)."""
        if self.weight_grad is not None:
            grad = self.weight_grad.dequantize() + grad
        self.weight_grad = ScaledTensor.from_float(
            grad,
            gradient_dtype(self.recipe.fp8_format),
            margin=self.recipe.margin,
            power_of_2=self.recipe.power_of_2_scales,
        )
        if run_hooks:
            for hook in list(self._weight_grad_hooks.values()):
                hook(self.weight)

    def register_weight_grad_hook(self, hook: Callable[[nn.Parameter], None]) -> RemovableHandle:
        """Call ``hook(weight)`` each time backward has added to ``weight_grad`` (the FP8
        counterpart of ``Tensor.register_post_accumulate_grad_hook``)."""
        handle = RemovableHandle(self._weight_grad_hooks)
        self._weight_grad_hooks[handle.id] = hook
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` of shape (..., in_features)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8Linear expects inputs of shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        """Shape, weight storage and recipe, for ``print(model)``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.weight_dtype}, "
            f"format={self.recipe.fp8_format.value}, scaling={self.recipe.scaling.value}"
        )


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward and both backward GEMMs of ``Fp8Linear`` (fprop, dgrad, wgrad)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: nn.Parameter,
        bias: torch.Tensor | None,
        layer: Fp8Linear,
    ) -> torch.Tensor:
        high_fprop, high_dgrad, high_wgrad = layer.recipe.override_linear_precision
        x2 = x.reshape(-1, layer.in_features)  # (M, K)
        out_dtype = x.dtype
        w8 = layer.fp8_weight() if not (high_fprop and high_dgrad) else None  # (N, K)
        if high_fprop:
            y = (x2.float() @ layer.read_weight().t()).to(out_dtype)
        else:
            x8 = layer.cast(Slot.INPUT, x2)
            y = fp8_mm(x8.data.contiguous(), w8.data.t(), x8.scale, w8.scale, out_dtype, GemmRole.FPROP)
        if bias is not None:
            y = y + bias.to(out_dtype)
        wgrad_input = x2 if high_wgrad else (x8 if not high_fprop else layer.cast(Slot.INPUT, x2))
        ctx.layer = layer
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.w8 = w8
        ctx.wgrad_input = wgrad_input
        return y.reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        layer: Fp8Linear = ctx.layer
        high_fprop, high_dgrad, high_wgrad = layer.recipe.override_linear_precision
        needs_x, needs_w, needs_b, _ = ctx.needs_input_grad
        g2 = grad_output.reshape(-1, layer.out_features)  # (M, N)
        g8 = None
        if (needs_x and not high_dgrad) or (needs_w and not high_wgrad):
            g8 = layer.cast(Slot.GRAD_OUTPUT, g2)

        grad_x = None
        if needs_x:
            if high_dgrad:
                grad_x = (g2.float() @ layer.read_weight()).to(ctx.x_dtype)
            else:
                w8: ScaledTensor = ctx.w8
                grad_x = fp8_mm(
                    g8.data.contiguous(), _column_major(w8.data), g8.scale, w8.scale,
                    ctx.x_dtype, GemmRole.DGRAD,
                )
            grad_x = grad_x.reshape(ctx.x_shape)

        if needs_w:
            if high_wgrad:
                grad_w = g2.float().t() @ ctx.wgrad_input.float()
            else:
                x8: ScaledTensor = ctx.wgrad_input
                grad_w = fp8_mm(
                    _pad_rows(g8.data, _GEMM_ALIGNMENT).t().contiguous(),
                    _column_major(_pad_rows(x8.data, _GEMM_ALIGNMENT)),
                    g8.scale, x8.scale, torch.float32, GemmRole.WGRAD,
                )
            layer.accumulate_weight_grad(grad_w)

        grad_b = g2.float().sum(0).to(ctx.bias_dtype) if needs_b else None
        ctx.w8 = ctx.wgrad_input = None
        return grad_x, None, grad_b, None
