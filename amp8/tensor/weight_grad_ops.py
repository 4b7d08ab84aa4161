"""What torch code may do with an FP8 weight gradient (``amp8.tensor.WeightGrad``), and what it
gets: the gradient's ``__torch_dispatch__``.

- Elementwise arithmetic and selection (``ELEMENTWISE``: ``+ - * /``, ``clamp``,
  ``torch.where``, ``masked_fill``, ...) runs on the real values in float32. A floating
  result of the gradient's shape is a gradient again: stored at the gradient's layout
  with fresh scales (so within one FP8 rounding of the float32 result). Other results
  (comparisons, broadcasts to another shape) are plain tensors.
- In place, the same operations store their result back into the gradient.
- Multiplying or dividing by a scalar is exact: only the scales change (clipping).
- Reductions and tests (``READS``: ``sum``, ``mean``, norms, ``isfinite``, ...) read the
  real values in float32 and return plain tensors; so do ``.float()`` and ``.to(dtype)``.
  ``.to(device)``, ``clone``, ``detach``, ``zero_``, ``copy_`` keep a gradient.
- ``torch._foreach_*`` forms run one tensor at a time.

An in-place operation on a plain tensor that reads a gradient raises a ``TypeError``: where
backward would add a new gradient to a plain tensor in the weight's ``.grad`` (one assigned
by hand), it says to clear ``.grad`` and let backward make the gradient; elsewhere (an
optimizer adding it to the scaled stored weight, or to its moments) it names amp8's
optimizer. Any other operation raises a ``TypeError`` that lists the supported ones.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from amp8.tensor.scaled import ScaledTensor

aten = torch.ops.aten

ELEMENTWISE = (
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "sign", "square", "pow", "reciprocal", "clamp",
    "clamp_min", "clamp_max", "where", "masked_fill", "nan_to_num", "maximum", "minimum", "lerp", "addcmul",
    "addcdiv", "fill", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_empty",
    "new_empty_strided",
)
"""Operations that give a gradient again where their result has the gradient's shape."""

READS = (
    "sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "max", "min", "aminmax", "std", "var",
    "isfinite", "isnan", "isinf", "eq", "ne", "lt", "le", "gt", "ge", "equal", "allclose", "isclose",
    "any", "all", "count_nonzero", "is_nonzero", "_local_scalar_dense",
)
"""Operations that read the real values and give plain tensors (or numbers)."""

OPTIMIZER_FIX = (
    "step FP8 weights with the optimizer amp8.initialize returns (or amp8.optim.LowBitAdam "
    "over the model's parameters), or keep weights and gradients as your optimizer expects "
    "with opt_level=amp8.config.levels.FP8_COMPUTE_ONLY"
)

PLAIN_GRAD_FIX = (
    "an FP8 weight's gradient is made by backward: clear it with optimizer.zero_grad() (or "
    "weight.grad = None) before backward, and do not assign a plain tensor to weight.grad"
)

_SUPPORTED = (
    f"elementwise, in and out of place: {', '.join(ELEMENTWISE)}; reading the real values: "
    f"{', '.join(READS)}; their torch._foreach_ forms; clone, detach, copy_, zero_, "
    ".to(device), and .float() / .to(dtype) for the real values as a plain tensor"
)


class WeightGradDispatch(torch.Tensor):
    """The base of ``amp8.tensor.WeightGrad``: sends every aten operation on it to
    ``dispatch``. (The gradient's class is built on this one, so this module need not
    import it.)"""

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``func`` as ``dispatch`` says."""
        return dispatch(func, args, kwargs or {})


WeightGrad = WeightGradDispatch  # what the annotations and checks below mean


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the aten operation ``func`` with a ``WeightGrad`` among its arguments."""
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return _foreach(name[len("_foreach_"):], args, kwargs)
    in_place = name.endswith("_")
    base = name[:-1] if in_place else name
    if base not in ELEMENTWISE and base not in READS:
        raise _unsupported(str(func))
    if in_place and not isinstance(args[0], WeightGrad):
        raise _written_into_plain(str(func), args[0])
    if base in ("mul", "div") and not kwargs:
        exact = _scaled_exactly(name, *args)
        if exact is not None:
            return exact
    if in_place:
        return _in_place(func, args[0], args[1:], kwargs)
    return _elementwise(func, args, kwargs, base in ELEMENTWISE)


def _written_into_plain(operation: str, target: torch.Tensor) -> TypeError:
    """The error for ``operation`` writing a gradient into the plain tensor ``target``."""
    if _accumulating_into(target):
        return TypeError(
            "amp8: backward cannot add an FP8 weight gradient to the weight's .grad, which holds a "
            "plain tensor (assigned outside backward, e.g. weight.grad = torch.zeros_like(weight)); "
            f"{PLAIN_GRAD_FIX}"
        )
    return TypeError(
        f"amp8: {operation} would write an FP8 weight gradient (1 byte per element, the gradient "
        f"of the real weight, which the parameter stores scaled) into a plain tensor; {OPTIMIZER_FIX}"
    )


def _accumulating_into(target: torch.Tensor) -> bool:
    """Whether autograd is accumulating a gradient into ``target`` as a Parameter's
    ``.grad`` (the running backward node is that Parameter's ``AccumulateGrad``)."""
    node = torch._C._current_autograd_node()
    variable = getattr(node, "variable", None)
    return isinstance(variable, torch.Tensor) and variable.grad is target


def _unsupported(operation: str) -> TypeError:
    return TypeError(
        f"amp8: {operation} is not supported on an FP8 weight gradient (amp8.tensor.WeightGrad). Supported: {_SUPPORTED}"
    )


def _real(value: Any) -> Any:
    return value.dequantize() if isinstance(value, WeightGrad) else value


def _elementwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], gives_grad: bool) -> Any:
    """``func`` on the real values; a floating result of the gradient's shape is stored
    as a gradient like the first one among ``args`` where ``gives_grad``."""
    grad = next(value for value in tree_flatten((args, kwargs))[0] if isinstance(value, WeightGrad))
    if kwargs.get("dtype") not in (None, grad.dtype):  # ``zeros_like(g, dtype=...)``: a plain tensor
        gives_grad = False
    if gives_grad:
        kwargs = {key: value for key, value in kwargs.items() if key != "dtype"}
    result = func(*tree_map(_real, args), **tree_map(_real, kwargs))
    if not (gives_grad and isinstance(result, torch.Tensor) and result.is_floating_point()
            and result.shape == grad.shape):
        return result
    if func.overloadpacket.__name__ in _UNINITIALIZED:
        result.zero_()
    return type(grad).from_float(result, grad.grad_layout, grad.dtype)


def _in_place(func: Any, grad: WeightGrad, operands: tuple[Any, ...], kwargs: dict[str, Any]) -> WeightGrad:
    """The in-place ``func`` on ``grad``: on its real values, stored back with fresh scales."""
    real = grad.dequantize()
    func(real, *tree_map(_real, operands), **tree_map(_real, kwargs))
    return grad.store_(real)


def _factor(value: Any, grad: WeightGrad) -> float | torch.Tensor | None:
    """A scalar factor of ``grad`` (a number, or a one-element plain float tensor that
    broadcasts to ``grad``'s shape), else None."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and not isinstance(value, WeightGrad) and value.numel() == 1 and (
        value.is_floating_point() and value.dim() <= grad.dim()
    ):
        return value.detach().float().reshape(())
    return None


def _scaled_exactly(name: str, grad: Any, other: Any) -> WeightGrad | None:
    """``grad`` times or over a scalar (``name`` is ``mul``, ``mul_``, ``div`` or
    ``div_``), exactly: only the scales change. None where ``other`` is not a scalar."""
    if name == "mul" and not isinstance(grad, WeightGrad):  # ``2 * g``
        grad, other = other, grad
    factor = _factor(other, grad) if isinstance(grad, WeightGrad) else None
    if factor is None:
        return None
    divide = name.startswith("div")
    if name.endswith("_"):
        (grad._scale.mul_ if divide else grad._scale.div_)(factor)
        return grad
    return _with(grad, grad._data.clone(), grad._scale * factor if divide else grad._scale / factor)


def _zero_(grad: WeightGrad) -> WeightGrad:
    grad._data.view(torch.uint8).zero_()  # the zero byte is +0.0 in both FP8 formats
    grad._scale.fill_(1.0)
    return grad


def _copy_(destination: Any, source: Any, non_blocking: bool = False) -> Any:
    """Into a gradient: from one of its layout the bytes, exactly; from anything else its
    values, stored again. Into a plain tensor: the real values."""
    if not isinstance(destination, WeightGrad):
        return destination.copy_(source.dequantize(), non_blocking)
    if isinstance(source, WeightGrad) and source.grad_layout == destination.grad_layout:
        destination._data.copy_(source._data, non_blocking)
        destination._scale.copy_(source._scale, non_blocking)
        return destination
    return _in_place(aten.copy_.default, destination, (source,), {})


def _with(grad: WeightGrad, data: torch.Tensor, scale: torch.Tensor) -> WeightGrad:
    return type(grad)(ScaledTensor(data, scale, grad.grad_layout.block_size), grad.dtype, grad.grad_layout)


def _to_copy(grad: WeightGrad, **kwargs: Any) -> torch.Tensor:
    """``.float()``, ``.to(dtype)``: the real values (float32 unless asked); ``.to(device)``
    alone: the gradient, copied to that device."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if dtype in (None, grad.dtype):
        return _with(grad, grad._data.to(device=device, copy=True), grad._scale.to(device=device, copy=True))
    real = grad.dequantize(dtype)
    return real if device is None else real.to(device)


def _foreach(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``torch._foreach_`` operation one tensor at a time (the other tensors of the
    lists may be plain ones); ``name`` is the operation without its prefix."""
    method: Any = _vector_norm if name == "norm" else getattr(torch.Tensor, name, None)
    if method is None:
        raise _unsupported(f"torch._foreach_{name}")
    results = tuple(
        method(tensor, *[value[index] if isinstance(value, (list, tuple)) else value for value in args[1:]], **kwargs)
        for index, tensor in enumerate(args[0])
    )
    return None if name.endswith("_") else results


def _vector_norm(tensor: torch.Tensor, ord: float = 2.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(tensor, ord, dtype=dtype)


_UNINITIALIZED = ("empty_like", "new_empty", "new_empty_strided")
_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.detach.default: lambda grad: _with(grad, grad._data, grad._scale),
    aten.alias.default: lambda grad: _with(grad, grad._data, grad._scale),
    aten.detach_.default: lambda grad: grad,
    aten.clone.default: lambda grad, **_: _with(grad, grad._data.clone(), grad._scale.clone()),
    aten._to_copy.default: _to_copy,
    aten.zero_.default: _zero_,
    aten.copy_.default: _copy_,
}
