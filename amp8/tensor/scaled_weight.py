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
  step on the float32 values the last one wrote (see ``ScaledWeight.update``).
- ``detach()`` and ``w.data`` give a ``ScaledWeight`` that shares the storage; views
  (``w.view(-1)``, ``w.t()``, ``w[0]``, ``w.data[index]``) give a ``WeightView``, which
  reads as that view of the real weight and whose writes rewrite the weight
  (``w[0].zero_()``, ``w.view_as(q).copy_(q)`` as ``orthogonal_`` does).

How each aten operation runs on the weight and its views is
``amp8.tensor.scaled_weight_ops``; this module holds the weight itself: its storage, how
it stores new values, copies, pickles and ``torch.compile``'s view of it.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch

from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.scaled_weight_ops import WeightDispatch, real_values

_DATA_DESCRIPTOR = inspect.getattr_static(torch.Tensor, "data")


class ScaledWeight(WeightDispatch):
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

    def update(self, change: Callable[[torch.Tensor], None]) -> None:
        """Run ``change`` on the weight's real values in float32, in place, and store them
        as the whole weight, with fresh scales.

        The next update of a chain of in-place operations (``torch.nn.init.trunc_normal_``'s
        ``uniform_``, ``erfinv_``, ``mul_``, ...) starts from these float32 values, as on a
        plain weight: the storage's rounding of each step would otherwise add up (FP16
        rounds a uniform sample to 1.0, whose erfinv is inf). They are kept on the stored
        tensor until it changes or is read (``end_chain``, ``drop_chain``).
        """
        real = _chained(self._data)
        if real is None:
            real = self.dequantize(torch.float32)
        change(real)
        self.write(real)
        self._data.__dict__[_CHAIN] = (real, self._data._version)

    def end_chain(self) -> None:
        """Forget the float32 values the last ``update`` kept (4 bytes per element)."""
        drop_chain(self._data)

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
            self.write(real_values(value))


_CHAIN = "_amp8_chained_values"


def _chained(data: torch.Tensor) -> torch.Tensor | None:
    """The float32 values the last in-place operation wrote into the stored tensor
    ``data``, while it holds them still (no other write since)."""
    chained = data.__dict__.get(_CHAIN)
    if chained is None or chained[1] != data._version:
        return None
    return chained[0]


def chained_nbytes(data: torch.Tensor) -> int:
    """Bytes of the float32 values a chain of in-place writes keeps on the stored tensor
    ``data`` (0 when none is kept, or the storage changed since)."""
    chained = _chained(data)
    return 0 if chained is None else chained.nbytes


def drop_chain(data: torch.Tensor) -> None:
    """Forget the float32 values a chain of in-place operations left on the stored
    tensor ``data`` (they cost 4 bytes per element): at a read, and when the layer uses
    the weight."""
    data.__dict__.pop(_CHAIN, None)


_OWN = ("_data", "_scale", "block_size", "writer", "_is_param")


def _traced_write(value: torch.Tensor) -> None:
    raise RuntimeError("amp8: a weight inside a compiled graph cannot be written; write it outside torch.compile")


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
