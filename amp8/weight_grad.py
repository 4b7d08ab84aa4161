"""``WeightGrad``: an FP8 weight gradient that sits in ``weight.grad``.

An FP8 layer's weight gradient is stored in one byte per element (FP8 data and float32
scales), and it is the gradient of the layer's *real* weight (what ``read_weight()``
returns), not of the scaled FP16 or FP8 numbers the Parameter stores. ``WeightGrad`` is a
``torch.Tensor`` subclass with the Parameter's shape and dtype around those two tensors,
so torch's own tools find and handle it where they look for gradients:

- ``model.zero_grad()`` and ``optimizer.zero_grad()`` drop it (or zero it in place);
- ``torch.nn.utils.clip_grad_norm_`` measures its real values and clips it by changing
  its scale, exactly (the FP8 data stays as it is);
- ``.float()``, ``.to(dtype)``, ``.abs()``, ``.isfinite()``, norms and reductions read
  its real values, in float32.

Everything else raises a ``TypeError`` that says what to do: an optimizer that would add
the real gradient to the scaled stored weight (``torch.optim.SGD`` or ``AdamW`` built by
hand over an amp8 model) must not step silently wrong.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from .tensor import ScaledTensor

aten = torch.ops.aten

_FIX = (
    "step FP8 weights with the optimizer amp8.initialize returns (or amp8.optim.LowBitAdam "
    "over the model's parameters), or keep weights and gradients as your optimizer expects "
    "with opt_level=amp8.levels.FP8_COMPUTE_ONLY"
)


class WeightGrad(torch.Tensor):
    """The FP8 gradient of an FP8 layer's real weight, as that weight's ``.grad``.

    Attributes:
        fp8: the FP8 data and its float32 scales (tensorwise, per row or per block, like
            the weight's own scales), as a ``ScaledTensor`` that shares their memory.
    """

    fp8: ScaledTensor

    @staticmethod
    def __new__(cls, fp8: ScaledTensor, dtype: torch.dtype) -> "WeightGrad":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, fp8.shape, dtype=dtype, device=fp8.data.device, requires_grad=False
        )

    def __init__(self, fp8: ScaledTensor, dtype: torch.dtype) -> None:
        self.fp8 = fp8

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"WeightGrad(shape={tuple(self.shape)}, data={self.fp8.dtype}, "
            f"scale={tuple(self.fp8.scale.shape)}, real={self.dequantize()})"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real gradient in ``dtype``."""
        return self.fp8.dequantize(dtype)

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        """Bytes really held: the FP8 data plus its scales."""
        return self.fp8.nbytes

    def _rescaled(self, factor: torch.Tensor | float) -> "WeightGrad":
        return WeightGrad(ScaledTensor(self.fp8.data, self.fp8.scale / factor, self.fp8.block_size), self.dtype)

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func.overloadpacket in _READS:
            real = tree_map(_real, (args, kwargs))
            return func(*real[0], **real[1])
        if func.overloadpacket in _FOREACH_INPLACE:
            return _foreach_inplace(func.overloadpacket, *args, **kwargs)
        raise TypeError(
            f"amp8: {func} cannot use an FP8 weight gradient (1 byte per element, the "
            f"gradient of the real weight, which the parameter stores scaled); {_FIX}"
        )


def _real(value: Any) -> Any:
    return value.dequantize() if isinstance(value, WeightGrad) else value


def _factor(value: Any) -> torch.Tensor | float:
    """A scalar factor (a number or a one-element tensor), else a ``TypeError``."""
    if isinstance(value, numbers.Number):
        return float(value)  # type: ignore[arg-type]
    if isinstance(value, torch.Tensor) and not isinstance(value, WeightGrad) and value.numel() == 1:
        return value.detach().float().reshape(())
    raise TypeError(f"amp8: an FP8 weight gradient can be multiplied by a scalar only; {_FIX}")


def _mul_(grad: WeightGrad, factor: Any) -> WeightGrad:
    """Multiply in place, exactly: the scale is divided, the FP8 data stays."""
    grad.fp8.scale.div_(_factor(factor))
    return grad


def _div_(grad: WeightGrad, factor: Any) -> WeightGrad:
    grad.fp8.scale.mul_(_factor(factor))
    return grad


def _zero_(grad: WeightGrad) -> WeightGrad:
    grad.fp8.data.view(torch.uint8).zero_()  # the zero byte is +0.0 in both FP8 formats
    grad.fp8.scale.fill_(1.0)
    return grad


def _copy_(grad: WeightGrad, source: Any, non_blocking: bool = False) -> WeightGrad:
    if not isinstance(source, WeightGrad) or source.fp8.scale.shape != grad.fp8.scale.shape:
        raise TypeError(f"amp8: an FP8 weight gradient can be copied from another of its layout only; {_FIX}")
    grad.fp8.data.copy_(source.fp8.data)
    grad.fp8.scale.copy_(source.fp8.scale)
    return grad


def _same(grad: WeightGrad, *args: Any, **kwargs: Any) -> WeightGrad:
    return WeightGrad(grad.fp8, grad.dtype)


def _clone(grad: WeightGrad, **kwargs: Any) -> WeightGrad:
    fp8 = ScaledTensor(grad.fp8.data.clone(), grad.fp8.scale.clone(), grad.fp8.block_size)
    return WeightGrad(fp8, grad.dtype)


def _to_copy(grad: WeightGrad, **kwargs: Any) -> torch.Tensor:
    """``.float()``, ``.to(dtype)``, ``.cpu()``: the real values, float32 unless asked."""
    real = grad.dequantize(kwargs.get("dtype") or torch.float32)
    device = kwargs.get("device")
    return real if device is None else real.to(device)


def _mul(grad: Any, factor: Any) -> WeightGrad:
    if not isinstance(grad, WeightGrad):
        grad, factor = factor, grad
    return grad._rescaled(1.0 / _factor(factor))


def _div(grad: WeightGrad, factor: Any) -> WeightGrad:
    return grad._rescaled(_factor(factor))


def _foreach_inplace(packet: Any, tensors: list[torch.Tensor], *operands: Any, **kwargs: Any) -> None:
    """``torch._foreach_mul_``, ``_foreach_div_`` and ``_foreach_zero_``, one tensor at a
    time (the other tensors of the list may be plain ones)."""
    name = _FOREACH_INPLACE[packet]
    operand = operands[0] if operands else None
    for index, tensor in enumerate(tensors):
        method = getattr(tensor, name)
        if operand is None:
            method()
        else:
            method(operand[index] if isinstance(operand, (list, tuple)) else operand)


_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.detach.default: _same,
    aten.alias.default: _same,
    aten.detach_.default: lambda grad: grad,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten.div_.Tensor: _div_,
    aten.div_.Scalar: _div_,
    aten.mul.Tensor: _mul,
    aten.mul.Scalar: _mul,
    aten.div.Tensor: _div,
    aten.div.Scalar: _div,
    aten.zero_.default: _zero_,
    aten.copy_.default: _copy_,
}
# Reductions and tests that only read the gradient: they see its real values, in float32.
# Arithmetic that an optimizer could feed back into the scaled weight is not among them.
_READS = {
    aten.linalg_vector_norm, aten.norm, aten.abs, aten.isfinite, aten.isnan, aten.isinf,
    aten.amax, aten.amin, aten.max, aten.min, aten.sum, aten.mean, aten.eq, aten.ne,
    aten.equal, aten.allclose, aten.any, aten.all,
}
_FOREACH_INPLACE = {aten._foreach_mul_: "mul_", aten._foreach_div_: "div_", aten._foreach_zero_: "zero_"}
