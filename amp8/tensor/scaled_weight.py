"""``ScaledWeight``: an FP8 layer's weight Parameter, which reads as the real weight.

An FP8 layer stores its weight as ``w * scale`` in FP16 (O1, O2) or FP8 (O3) beside the
scale (``amp8.tensor.StoredWeight``). The weight Parameter is a ``ScaledWeight`` around
those two tensors: it reports the dtype the model had before ``amp8.initialize`` and the
weight's shape, and to any torch code it reads as ``w``, dequantized on each read, while
amp8's GEMMs read the stored tensors directly. It is the twin of the gradient contract
(``amp8.tensor.WeightGrad``).

What torch code gets from it:

- Reads (``w.float()``, ``w.norm()``, ``w @ x``, ``w.to(dtype)``, ``w.clone()``, views and
  indexing, ``torch.equal``, ...) run on the real values in the reported dtype and give
  plain tensors.
- Writes re-encode the whole weight, with fresh scales: ``copy_``, ``fill_``,
  ``zero_``, ``torch.nn.init.*_``, in-place arithmetic (``mul_``, ``add_``, ...),
  ``w.data = value`` and ``w[index] = value``. A chain of in-place operations runs each
  step on the float32 values the last one wrote (see ``_chained``).
- ``detach()`` and ``w.data`` give a ``ScaledWeight`` that shares the storage; views
  (``w.view(-1)``, ``w.t()``, ``w[0]``, ``w.data[index]``) give a ``WeightView``, which
  reads as that view of the real weight and whose writes rewrite the weight
  (``w[0].zero_()``, ``w.view_as(q).copy_(q)`` as ``orthogonal_`` does).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from amp8.tensor.scaled import ScaledTensor

aten = torch.ops.aten
_DATA_DESCRIPTOR = inspect.getattr_static(torch.Tensor, "data")
_SHARED = (aten.detach.default, aten.alias.default)
_REFUSED = ("set_", "resize_", "as_strided_", "resize_as_")


class ScaledWeight(torch.Tensor):
    """The weight Parameter of an FP8 layer: stored scaled, read as real values.

    Args:
        data: the stored tensor, ``w * scale`` in FP16 or FP8 (kept, not copied).
        scale: its scales (the layer's ``{name}_scale`` buffer, kept, not copied): one, per
            row, or per ``block_size`` block, in float32 or the recipe's scale dtype.
        block_size: elements per block edge of block scales (0 otherwise).
        dtype: the dtype it reports and reads as (the model's, before ``initialize``).
        writer: stores new real values of the whole weight (the weight's
            ``StoredWeight.write``), where writes go.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    block_size: int
    writer: Callable[[torch.Tensor], None]

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype,
        writer: Callable[[torch.Tensor], None],
    ) -> "ScaledWeight":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(
        self, data: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype,
        writer: Callable[[torch.Tensor], None],
    ) -> None:
        self._data, self._scale, self.block_size, self.writer = data, scale, block_size, writer

    def stored(self) -> ScaledTensor:
        """The stored tensor and its float32 scales, sharing memory with this weight."""
        return ScaledTensor(self._data, self._scale.float(), self.block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The real weight, as a plain tensor of ``dtype`` (the reported dtype by default)."""
        return self.stored().dequantize(dtype or self.dtype)

    def write(self, value: torch.Tensor) -> None:
        """Store ``value`` (real values of the weight's shape) as the whole weight, with
        fresh scales."""
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(
                f"cannot write a tensor of shape {tuple(value.shape)} into an FP8 layer's weight of shape "
                f"{tuple(self.shape)}: write values of the weight's shape (build a new layer to change it)"
            )
        self.writer(value.detach().to(self.device, torch.float32))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ScaledWeight(stored as {self._data.dtype} with scales of shape {tuple(self._scale.shape)}, " \
               f"reads as {self.dequantize()!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle (``torch.save`` of a whole model) with the stored tensors and the writer."""
        return (_rebuild, (self._data, self._scale, self.block_size, self.dtype, self.writer, self.requires_grad,
                           isinstance(self, torch.nn.Parameter)))

    def __deepcopy__(self, memo: dict[int, Any]) -> "ScaledWeight":
        """A copy with copies of the stored tensors (through ``memo``, so a copied layer's
        scale buffer and its copied weight share one tensor) and of the writer."""
        if id(self) in memo:
            return memo[id(self)]
        result = ScaledWeight(
            copy.deepcopy(self._data, memo), copy.deepcopy(self._scale, memo), self.block_size, self.dtype,
            copy.deepcopy(self.writer, memo),
        )
        result.requires_grad_(self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            result._is_param = True  # type: ignore[attr-defined]
        extra = {key: value for key, value in self.__dict__.items() if key not in _OWN}
        result.__dict__.update(copy.deepcopy(extra, memo))
        memo[id(self)] = result
        return result

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, int]]:
        """The stored tensors and what rebuilds the wrapper (torch.compile), without the
        writer: compiled code reads the storage and never writes the weight."""
        return ["_data", "_scale"], (self.dtype, self.block_size)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], context: tuple[torch.dtype, int], outer_size: Any, outer_stride: Any
    ) -> "ScaledWeight":
        """The wrapper around ``inner`` (see ``__tensor_flatten__``)."""
        dtype, block_size = context
        return ScaledWeight(inner["_data"], inner["_scale"], block_size, dtype, _traced_write)

    # No ``__torch_function__`` of its own: torch's fast path for subclasses, so reading
    # the Parameter's shape, dtype or ``requires_grad`` costs what a plain tensor's does.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def tolist(self) -> Any:  # type: ignore[override]
        """The real values as nested Python lists, as ``Tensor.tolist``."""
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """The real values as a NumPy array (a copy: the storage holds scaled values),
        with ``Tensor.numpy``'s rule that a tensor requiring grad needs ``detach()``."""
        return _numpy(self, force)

    def alias(self) -> "ScaledWeight":
        """This weight, detached, sharing the storage (writes into it reach the layer)."""
        return ScaledWeight(self._data, self._scale, self.block_size, self.dtype, self.writer)

    @property  # type: ignore[override]
    def data(self) -> "ScaledWeight":
        """The weight, detached, sharing the storage (``w.data.mul_(2)`` writes it)."""
        return self.alias()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``w.data = value`` stores ``value``'s real values as the whole weight."""
        if isinstance(value, ScaledWeight) and value._data is self._data:
            return
        with torch.no_grad():
            self.write(_real(value))

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Reads on the real values; in-place operations on a ``ScaledWeight`` write it."""
        return _dispatch(func, args, kwargs or {})


class WeightView(torch.Tensor):
    """A view of a ``ScaledWeight`` (``w.t()``, ``w.view(-1)``, ``w[0]``): reads as that
    view of the real weight; an in-place operation on it changes the view of the real
    weight and stores the whole weight again.

    Args:
        base: the weight.
        view: the view, as a function of a tensor of the weight's shape.
        example: the view of the real weight (its shape and strides).
    """

    base: ScaledWeight
    view: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def __new__(cls, base: ScaledWeight, view: Callable[[torch.Tensor], torch.Tensor],
                example: torch.Tensor) -> "WeightView":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, example.shape, strides=example.stride(), dtype=base.dtype, device=base.device, requires_grad=False
        )

    def __init__(self, base: ScaledWeight, view: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor) -> None:
        self.base, self.view = base, view

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This view of the real weight, as a plain tensor of ``dtype`` (the reported one
        by default)."""
        return self.view(self.base.dequantize(dtype))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"WeightView(of an FP8 layer's weight, reads as {self.dequantize()!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def tolist(self) -> Any:  # type: ignore[override]
        """The real values of this view as nested Python lists."""
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """The real values of this view as a NumPy array (a copy)."""
        return _numpy(self, force)

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """As ``ScaledWeight``'s: reads on the real view, writes through to the weight."""
        return _dispatch(func, args, kwargs or {})


_STORED = (ScaledWeight, WeightView)


def _numpy(tensor: "ScaledWeight | WeightView", force: bool) -> Any:
    if tensor.requires_grad and not force:
        raise RuntimeError(
            "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
        )
    return tensor.dequantize().numpy(force=force)


def _weight_and_view(tensor: torch.Tensor) -> tuple[ScaledWeight, Callable[[torch.Tensor], torch.Tensor]]:
    if isinstance(tensor, WeightView):
        return tensor.base, tensor.view
    return tensor, _whole  # type: ignore[return-value]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The aten operation ``func`` with a ``ScaledWeight`` or ``WeightView`` among its
    arguments (see the module's docstring). Which arguments an operation writes comes
    from its schema (``Tensor(a!)``: in-place operations, ``out=``, foreach lists)."""
    target = args[0] if args else None
    stored = isinstance(target, _STORED)
    if func in _SHARED and stored:
        if isinstance(target, WeightView):
            return WeightView(target.base, target.view, target.dequantize())
        return target.alias()
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
        weight, view = _weight_and_view(target)
        rest = args[1:]
        viewed = func(view(weight.dequantize()), *rest, **kwargs)
        if isinstance(viewed, torch.Tensor):
            return WeightView(weight, lambda t: func(view(t), *rest, **kwargs), viewed)
        return type(viewed)(
            WeightView(weight, lambda t, i=index: func(view(t), *rest, **kwargs)[i], part)  # type: ignore[misc]
            for index, part in enumerate(viewed)
        )
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, _STORED):
            drop_chain(_weight_and_view(value)[0]._data)
    return func(*tree_map(_real, args), **tree_map(_real, kwargs))


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
    a stored weight, with its slot; None where it writes none."""
    for slot in _written_slots(func):
        index, name = slot
        value = args[index] if 0 <= index < len(args) else kwargs.get(name)
        if value is not None and _holds_stored(value):
            return slot, value
    return None


def _holds_stored(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, _STORED) for item in value)
    return isinstance(value, _STORED)


def _write_through(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], slot: _Slot, value: Any) -> Any:
    """Run ``func``, which writes ``value`` (a stored weight, or a list holding some) at
    ``slot``, on float32 real values in place of each written weight, then store each
    one's new values.

    A foreach operation runs one element at a time: a list may mix weights, which are
    written in float32, with plain tensors in their own dtypes.
    """
    index, name = slot
    if isinstance(value, (list, tuple)) and len(value) > 1:
        for element in range(len(value)):
            _dispatch(func, _element(args, element), _element(kwargs, element))
        return None
    listed = isinstance(value, (list, tuple))
    if listed:
        value = value[0]
    if not isinstance(value, _STORED):  # one element of a foreach list, not a weight
        func(*tree_map(_real, args), **tree_map(_real, kwargs))
        return None
    weight, view = _weight_and_view(value)
    if func is aten.copy_.default and view is _whole and isinstance(args[1], ScaledWeight) and (
        args[1]._data is weight._data
    ):
        return value
    real = _chained(weight)
    if real is None:
        real = weight.dequantize(torch.float32)
    substitute = [view(real)] if listed else view(real)
    new_args = [_real_float32(arg) for arg in args]
    new_kwargs = {key: _real_float32(arg) for key, arg in kwargs.items()}
    if 0 <= index < len(new_args):
        new_args[index] = substitute
    else:
        new_kwargs[name] = substitute
    func(*new_args, **new_kwargs)
    weight.write(real)
    # The next in-place operation of a chain (``torch.nn.init.trunc_normal_``'s
    # uniform_, erfinv_, mul_, ...) starts from these float32 values, as on a plain
    # weight: the storage's rounding of each step would otherwise add up (FP16 rounds a
    # uniform sample to 1.0, whose erfinv is inf). Kept until the storage changes or is
    # read (``drop_chain``).
    weight._data.__dict__[_CHAIN] = (real, weight._data._version)
    return None if listed else value


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
    return tree_map(_float32, tree_map(_real, value))


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


_CHAIN = "_amp8_chained_values"


def _chained(weight: ScaledWeight) -> torch.Tensor | None:
    """The float32 values the last in-place operation on ``weight`` wrote, while the
    storage holds them still (no other write since)."""
    chained = weight._data.__dict__.get(_CHAIN)
    if chained is None or chained[1] != weight._data._version:
        return None
    return chained[0]


def chained_nbytes(data: torch.Tensor) -> int:
    """Bytes of the float32 values a chain of in-place writes keeps on the stored tensor
    ``data`` (0 when none is kept, or the storage changed since)."""
    chained = data.__dict__.get(_CHAIN)
    if chained is None or chained[1] != data._version:
        return 0
    return chained[0].nbytes


def drop_chain(data: torch.Tensor) -> None:
    """Forget the float32 values a chain of in-place operations left on the stored
    tensor ``data`` (they cost 4 bytes per element): at a read, and when the layer uses
    the weight."""
    data.__dict__.pop(_CHAIN, None)


_OWN = ("_data", "_scale", "block_size", "writer", "_is_param")


def _traced_write(value: torch.Tensor) -> None:
    raise RuntimeError("amp8: a weight inside a compiled graph cannot be written; write it outside torch.compile")


def _real(value: Any) -> Any:
    return value.dequantize() if isinstance(value, _STORED) else value


def _rebuild(
    data: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype, writer: Any, requires_grad: bool,
    is_param: bool,
) -> ScaledWeight:
    weight = ScaledWeight(data, scale, block_size, dtype, writer)
    weight.requires_grad_(requires_grad)
    if is_param:
        weight._is_param = True  # type: ignore[attr-defined]
    return weight


def retarget(weight: ScaledWeight, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Make ``weight`` (the same object: optimizers, hooks and tied modules keep it) hold
    ``data`` and ``scale`` and report ``dtype`` on ``data``'s device (after ``.to()``).
    True where the tensor was swapped whole (its autograd hooks are gone: register them
    again)."""
    if weight.dtype != dtype or weight.device != data.device:
        shell = ScaledWeight(data, scale, weight.block_size, dtype, weight.writer)
        try:
            _DATA_DESCRIPTOR.__set__(weight, shell)  # torch's own setter: the wrapper's dtype and device
        except RuntimeError:
            # Between device types whose tensors torch will not share a set_data across
            # (to and from "meta"): swap the whole tensor, keeping the Python object.
            shell.__dict__.update({key: value for key, value in weight.__dict__.items() if key not in _OWN})
            shell.requires_grad_(weight.requires_grad)
            torch.utils.swap_tensors(weight, shell)
            weight._data, weight._scale = data, scale
            return True
    weight._data, weight._scale = data, scale
    return False
