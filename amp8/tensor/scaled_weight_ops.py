"""What torch code may do with an FP8 layer's weight (``amp8.tensor.ScaledWeight``) and its
views, and what it gets: their ``__torch_dispatch__``.

- Reads (``w.float()``, ``w.norm()``, ``w @ x``, ``torch.equal``, ...) run on the real
  values in the reported dtype and give plain tensors.
- An operation that writes a weight runs on float32 real values in place of each weight
  it writes, which then stores its new values whole, with fresh scales
  (``WeightDispatch.update``). Which arguments it writes comes from its schema
  (``Tensor(a!)``: in-place operations, ``out=``, foreach lists); a foreach operation
  runs one element at a time, so a list may mix weights and plain tensors.
- Views (``w.view(-1)``, ``w.t()``, ``w[0]``) give a ``WeightView``, which reads as that
  view of the real weight and whose writes rewrite the weight (``w[0].zero_()``,
  ``w.view_as(q).copy_(q)`` as ``orthogonal_`` does).
- ``detach`` and ``alias`` share the storage; ``set_``, ``resize_`` and the like raise a
  ``TypeError`` that says how to write new values.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_SHARED = (aten.detach.default, aten.alias.default)
_REFUSED = ("set_", "resize_", "as_strided_", "resize_as_")

View = Callable[[torch.Tensor], torch.Tensor]
"""A view of a tensor of the weight's shape, as a function of it."""


class WeightDispatch(torch.Tensor):
    """The base of ``amp8.tensor.ScaledWeight`` (the whole weight) and ``WeightView`` (a
    view of it): a tensor that reads as real weight values it does not hold, and sends
    every aten operation on it to ``dispatch``. (The weight's class is built on this
    one, so this module need not import it.) A subclass says how it reads
    (``dequantize``), shares (``alias``) and writes (``update``, ``end_chain``)."""

    # No ``__torch_function__`` of its own: torch's fast path for subclasses, so reading
    # the Parameter's shape, dtype or ``requires_grad`` costs what a plain tensor's does.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The real values, as a plain tensor of ``dtype`` (the reported dtype by default)."""
        raise NotImplementedError

    def alias(self) -> "WeightDispatch":
        """This tensor, detached, sharing the storage (writes into it reach the layer)."""
        raise NotImplementedError

    def update(self, change: Callable[[torch.Tensor], None]) -> None:
        """Run ``change`` on this tensor's real values in float32, in place, and store the
        whole weight from them with fresh scales."""
        raise NotImplementedError

    def end_chain(self) -> None:
        """Forget the float32 values the last ``update`` left for the next one: a read of
        the weight ends a chain of in-place operations."""
        raise NotImplementedError

    def tolist(self) -> Any:  # type: ignore[override]
        """The real values as nested Python lists, as ``Tensor.tolist``."""
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """The real values as a NumPy array (a copy: the storage holds scaled values),
        with ``Tensor.numpy``'s rule that a tensor requiring grad needs ``detach()``."""
        if self.requires_grad and not force:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        return self.dequantize().numpy(force=force)

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Reads on the real values; operations that write the tensor write the weight."""
        return dispatch(func, args, kwargs or {})


class WeightView(WeightDispatch):
    """A view of a ``ScaledWeight`` (``w.t()``, ``w.view(-1)``, ``w[0]``): reads as that
    view of the real weight; an in-place operation on it changes the view of the real
    weight and stores the whole weight again.

    Args:
        base: the weight.
        view: the view, as a function of a tensor of the weight's shape.
        example: the view of the real weight (its shape and strides).
    """

    base: WeightDispatch
    view: View

    @staticmethod
    def __new__(cls, base: WeightDispatch, view: View, example: torch.Tensor) -> "WeightView":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, example.shape, strides=example.stride(), dtype=base.dtype, device=base.device, requires_grad=False
        )

    def __init__(self, base: WeightDispatch, view: View, example: torch.Tensor) -> None:
        self.base, self.view = base, view

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This view of the real weight, as a plain tensor of ``dtype`` (the reported one
        by default)."""
        return self.view(self.base.dequantize(dtype))

    def alias(self) -> "WeightView":
        """This view, detached, of the same weight."""
        return WeightView(self.base, self.view, self.dequantize())

    def update(self, change: Callable[[torch.Tensor], None]) -> None:
        """Run ``change`` on this view of the weight's float32 real values, in place, and
        store the whole weight from them."""
        view = self.view
        self.base.update(lambda real: change(view(real)))

    def end_chain(self) -> None:
        """End the weight's chain of in-place operations (see ``WeightDispatch``)."""
        self.base.end_chain()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"WeightView(of an FP8 layer's weight, reads as {self.dequantize()!r})"


def real_values(value: Any) -> Any:
    """``value``'s real values where it is a weight or a view of one, else ``value``."""
    return value.dequantize() if isinstance(value, WeightDispatch) else value


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The aten operation ``func`` with a weight or a view of one among its arguments
    (see the module's docstring)."""
    target = args[0] if args else None
    stored = isinstance(target, WeightDispatch)
    if func in _SHARED and stored:
        return target.alias()  # type: ignore[union-attr]
    if func is aten.detach_.default:
        return target
    if func.overloadpacket.__name__ in _REFUSED:
        raise TypeError(
            f"amp8: {func} is not supported on an FP8 layer's weight (stored scaled); write new values "
            "with weight.copy_(value) or weight.data = value"
        )
    written = _written_weight(func, args, kwargs)
    if written is not None:
        return _write_through(func, args, kwargs, *written)
    if stored and func.is_view:
        return _view(func, target, args[1:], kwargs)  # type: ignore[arg-type]
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, WeightDispatch):
            value.end_chain()
    return func(*tree_map(real_values, args), **tree_map(real_values, kwargs))


def _weight_and_view(tensor: WeightDispatch) -> tuple[WeightDispatch, View]:
    if isinstance(tensor, WeightView):
        return tensor.base, tensor.view
    return tensor, _whole


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _view(func: Any, target: WeightDispatch, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The view operation ``func`` of ``target``: a ``WeightView`` of its weight (a tuple
    of them where ``func`` gives several, as ``unbind`` does)."""
    weight, view = _weight_and_view(target)
    viewed = func(view(weight.dequantize()), *rest, **kwargs)
    if isinstance(viewed, torch.Tensor):
        return WeightView(weight, lambda t: func(view(t), *rest, **kwargs), viewed)
    return type(viewed)(
        WeightView(weight, lambda t, i=index: func(view(t), *rest, **kwargs)[i], part)  # type: ignore[misc]
        for index, part in enumerate(viewed)
    )


_Slot = tuple[int, str]  # an argument's position in ``args`` (-1: keyword-only) and its name


@functools.cache
def _written_slots(func: Any) -> tuple[_Slot, ...]:
    """The arguments ``func``'s schema marks as written (``Tensor(a!)``, ``Tensor(a!)[]``)."""
    return tuple(
        (-1 if argument.kwarg_only else index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _written_weight(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Slot, Any] | None:
    """The first argument of this call of ``func`` that it writes and that is (or lists)
    a weight or a view of one, with its slot; None where it writes none."""
    for slot in _written_slots(func):
        index, name = slot
        value = args[index] if 0 <= index < len(args) else kwargs.get(name)
        if value is not None and _holds_weight(value):
            return slot, value
    return None


def _holds_weight(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, WeightDispatch) for item in value)
    return isinstance(value, WeightDispatch)


def _write_through(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], slot: _Slot, value: Any) -> Any:
    """Run ``func``, which writes ``value`` (a weight or a view of one, or a list holding
    some) at ``slot``, on float32 real values in place of each written weight, then store
    each one's new values.

    A foreach operation runs one element at a time: a list may mix weights, which are
    written in float32, with plain tensors in their own dtypes.
    """
    index, name = slot
    if isinstance(value, (list, tuple)) and len(value) > 1:
        for element in range(len(value)):
            dispatch(func, _element(args, element), _element(kwargs, element))
        return None
    listed = isinstance(value, (list, tuple))
    if listed:
        value = value[0]
    if not isinstance(value, WeightDispatch):  # one element of a foreach list, not a weight
        func(*tree_map(real_values, args), **tree_map(real_values, kwargs))
        return None
    if func is aten.copy_.default and _is_alias_of(args[1], value):
        return value
    new_args = [_real_float32(arg) for arg in args]
    new_kwargs = {key: _real_float32(arg) for key, arg in kwargs.items()}

    def change(real: torch.Tensor) -> None:
        substitute = [real] if listed else real
        if 0 <= index < len(new_args):
            new_args[index] = substitute
        else:
            new_kwargs[name] = substitute
        func(*new_args, **new_kwargs)

    value.update(change)
    return None if listed else value


def _is_alias_of(source: Any, target: WeightDispatch) -> bool:
    """Whether ``source`` is the whole weight ``target`` is, or an alias of it
    (``w.copy_(w.data)``: nothing to write). Both are ``ScaledWeight``s then, whose
    ``_data`` is the stored tensor."""
    def whole(tensor: Any) -> bool:
        return isinstance(tensor, WeightDispatch) and not isinstance(tensor, WeightView)

    return whole(source) and whole(target) and source._data is target._data


def _element(container: Any, element: int) -> Any:
    """The arguments of one element of a foreach call: each list as a list of its
    ``element``-th item."""
    if isinstance(container, dict):
        return {key: _element(value, element) for key, value in container.items()}
    if isinstance(container, tuple):
        return tuple(_item(value, element) for value in container)
    return container


def _item(value: Any, element: int) -> Any:
    return [value[element]] if isinstance(value, (list, tuple)) else value


def _real_float32(value: Any) -> Any:
    """An argument of an operation that writes a weight in float32: its real values, in
    float32 where it is a floating tensor (``lerp_`` and friends take one dtype)."""
    return tree_map(_float32, tree_map(real_values, value))


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value
