"""``WeightGrad``: an FP8 weight gradient that is its weight's autograd gradient.

An FP8 layer's weight gradient is stored in one byte per element (FP8 data and float32
scales), and it is the gradient of the layer's *real* weight (what ``read_weight()``
returns), not of the scaled FP16 or FP8 numbers the Parameter stores. ``WeightGrad`` is a
``torch.Tensor`` subclass with the Parameter's shape, dtype and device around those two
tensors, so autograd hands it to the Parameter as any gradient: it lands in
``param.grad``, passes through ``register_hook`` and post-accumulate-grad hooks, is what
``torch.autograd.grad`` returns, and is summed where a layer is called twice or a
backward accumulates into an existing gradient.

It carries its ``GradLayout`` (FP8 dtype, scale tiles, margin, power-of-two scales), so
whatever gives a new gradient (a sum, ``clamp``, ``torch.where``) stores it again at the
same layout with fresh scales. The operations it supports, and what they give, are in
``amp8/tensor/weight_grad_ops.py``; anything else raises a ``TypeError`` that names them.

``WeightGradInFlight`` is the same gradient on its way out of a compiled backward: it
can be traced (``__tensor_flatten__``), which ``param.grad`` must not be (Dynamo cannot
fakeify a traceable subclass as the ``.grad`` of a plain Parameter). See DESIGN.md,
"Weight gradients".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from amp8._compat import OpaqueReferenceBase, register_opaque_reference
from amp8._compiled import call_compiled
from amp8.config.recipe import Recipe
from amp8.quant import scaling
from amp8.quant.codec import Layout
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad_ops import WeightGradDispatch


@dataclass(frozen=True)
class GradLayout:
    """How an FP8 weight gradient is stored: what quantizing it again needs.

    Attributes:
        dtype: the FP8 dtype of the data.
        tile: the (rows, columns) tile that shares one scale; None for one per tensor.
        block_size: elements per block edge of the scales, for ``ScaledTensor`` (0 unless
            the tiles are blocks).
        margin: scales are divided by ``2**margin``.
        power_of_2: scales are rounded down to powers of two.
    """

    dtype: torch.dtype
    tile: tuple[int, int] | None = None
    block_size: int = 0
    margin: int = 0
    power_of_2: bool = False

    @classmethod
    def for_weight(cls, recipe: Recipe, shape: tuple[int, ...]) -> "GradLayout":
        """The layout ``recipe`` gives the gradient of a weight of ``shape``:
        ``Recipe.weight_grad_dtype``, one scale per ``Recipe.weight_grad_tile`` (of each
        expert's matrix, for a stack of experts' weights: ``scaling.matrix_tile``), the
        recipe's margin and power-of-two rounding."""
        tile = scaling.matrix_tile(recipe.weight_grad_tile(shape), shape)
        block = recipe.scale_block_size
        block_size = block if tile is not None and block in tile else 0
        return cls(recipe.weight_grad_dtype, tile, block_size, recipe.margin, recipe.power_of_2_scales)

    def codec(self, shape: tuple[int, ...]) -> Layout:
        """The storage codec's layout of a gradient of ``shape`` at this layout."""
        return Layout.for_tile(self.dtype, self.tile, tuple(shape), margin=self.margin, power_of_2=self.power_of_2)

    def quantize(self, value: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> ScaledTensor:
        """The float ``value`` in FP8 at this layout, with fresh scales from its amaxes
        (written into ``out``'s data and scales where given). A scale is NaN where its
        tile holds an inf or NaN (the data there are NaN too), so an optimizer tells a
        gradient that must skip its step from the scales alone."""
        codec = self.codec(tuple(value.shape))
        amaxes = codec.amaxes(value)
        scale = codec.scales(amaxes) + amaxes * 0.0  # NaN where the amax is inf or NaN, unchanged elsewhere
        data, scale = codec.encode(value, scale)
        if out is not None:
            out[0].copy_(data)
            out[1].copy_(scale)
            data, scale = out
        return ScaledTensor(data, scale, self.block_size)

    def scale_shape(self, shape: tuple[int, ...]) -> torch.Size:
        """The shape of the scales of a gradient of ``shape`` (one per ``tile``)."""
        return scaling.tile_amax(torch.zeros(shape, device="meta"), self.tile).shape


def _quantized_parts(layout: GradLayout, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout.quantize(value)`` as (data, scales)."""
    fp8 = layout.quantize(value)
    return fp8.data, fp8.scale


def _quantized_into(layout: GradLayout, value: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """``layout.quantize(value)`` written into ``data`` and ``scale``."""
    fp8 = layout.quantize(value, out=(data, scale))
    del fp8


# A compiled backward can reach a slot through an operator of its own
# (``weight_grad_parts``) whose quantization then runs outside the graph. On an H200 that
# cost a gpt-1b step (O2, compiled blocks, batch 8) 46 ms of its 169 ms forward and
# backward, against about 1 ms for copying the gradients into their groups at the step
# (docs/decisions.md, 2026-11-30), so by default (None) compiled backwards take no slot:
# they quantize inside the graph and the step copies the gradient in. Set to a number of
# elements, gradients of that size or more take the slot.
COMPILED_SLOT_MIN_ELEMENTS: int | None = None


class GradSlot(OpaqueReferenceBase):
    """Memory an optimizer keeps for one FP8 weight's gradient (views of its flat gradient
    buffer), which the layer's backward writes the gradient into: the step then reads it
    where it is, with no copy.

    A backward takes the slot (``claim``) only where its weight has no gradient
    (``param.grad is None``: a later micro-batch adds to the one there, in place) and
    no other backward took it since the optimizer last read it (``round``, which the
    optimizer advances at each step): a layer called twice in one forward gets its first
    gradient in the slot and the second in memory of its own. As with DDP's
    ``gradient_as_bucket_view``, the gradient a step has read is overwritten by the next
    backward after ``zero_grad``: clone a gradient to keep it.

    Where ``COMPILED_SLOT_MIN_ELEMENTS`` is set (by default it is not: measured, the copy
    at the step costs a GPU less), a compiled backward reaches the slot through
    ``torch.ops.amp8.weight_grad_parts``, which torch.compile passes the slot to as an
    object it does not look into (``amp8._compat.register_opaque_reference``): the claim
    runs when the backward runs, as it does eagerly. In a torch without opaque objects
    compiled backwards take no slot."""

    __slots__ = ("data", "scale", "_param", "_round", "_claimed_in")

    def __init__(self, param: torch.Tensor | None, data: torch.Tensor | None, scale: torch.Tensor | None,
                 round: list[int]) -> None:
        self.data, self.scale = data, scale
        self._param = None if param is None else weakref.ref(param)
        self._round = round
        self._claimed_in = -1

    @classmethod
    def empty(cls) -> "GradSlot":
        """A slot with no memory, which no backward takes: what an optimizer gives its
        FP8 weights until it builds their groups at its first step, so that a graph
        compiled before then takes a slot as it will after (one slot replacing another
        compiles nothing new; a slot replacing None would). It holds no reference to the
        weight (a weak one would stop ``torch.utils.swap_tensors``)."""
        return cls(None, None, None, [0])

    def claim(self, shape: torch.Size) -> bool:
        """Whether this backward may write a gradient of ``shape`` here (see the class
        docstring); never for an ``empty`` slot."""
        if self.data is None or self.data.shape != shape or self._claimed_in == self._round[0]:
            return False
        param = None if self._param is None else self._param()
        if param is None or param.grad is not None:
            return False
        self._claimed_in = self._round[0]
        return True

    def __deepcopy__(self, memo: dict[int, Any]) -> "GradSlot":
        """The slot itself: memory held by reference (a model's copy holds no slot; see
        ``StoredWeight.__getstate__``)."""
        return self

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """A slot pickles as no slot: it belongs to the optimizer that made it. (torch
        2.11's compile cache pickles the arguments of a graph that takes one, for its key.)"""
        return _no_slot, ()


def _no_slot() -> None:
    """What a pickled ``GradSlot`` loads as."""
    return None


COMPILED_SLOTS = register_opaque_reference(GradSlot)
"""Whether compiled backwards can take slots (this torch passes a ``GradSlot`` through a
graph)."""


def _weight_grad_parts(layout: GradLayout, value: torch.Tensor, slot: GradSlot | None,
                       compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout.quantize(value)`` as (data, scales): written into ``slot`` where it may be
    claimed, else into memory of its own."""
    if slot is not None and slot.claim(value.shape):
        call_compiled(_quantized_into, layout, value, slot.data, slot.scale, compiled=compiled)
        return slot.data, slot.scale  # type: ignore[return-value]
    return call_compiled(_quantized_parts, layout, value, compiled=compiled)


def _layout_of(dtype: torch.dtype, tile: list[int] | None, block_size: int, margin: int,
               power_of_2: bool) -> GradLayout:
    """The ``GradLayout`` that ``weight_grad_parts``' arguments spell out (an operator takes
    no dataclass)."""
    return GradLayout(dtype, None if tile is None else (tile[0], tile[1]), block_size, margin, power_of_2)


@torch.library.custom_op("amp8::weight_grad_parts", mutates_args=())
def weight_grad_parts(value: torch.Tensor, slot: GradSlot, dtype: torch.dtype, tile: list[int] | None,
                      block_size: int, margin: int, power_of_2: bool,
                      compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight gradient's (data, scales) from the float gradient ``value``, stored at
    the ``GradLayout`` the other arguments give, in ``slot`` where the backward may claim
    it: ``WeightGrad.from_float`` inside a compiled graph. An operator of its own, so the
    claim (whether the weight has a gradient now, whether another backward took the slot
    since the last step) runs when the compiled backward runs, not once when it is
    traced; the outputs are the slot's own tensors where it was claimed."""
    layout = _layout_of(dtype, tile, block_size, margin, power_of_2)
    return _weight_grad_parts(layout, value, slot, compiled)


@weight_grad_parts.register_fake
def _weight_grad_parts_shapes(value: torch.Tensor, slot: GradSlot, dtype: torch.dtype, tile: list[int] | None,
                              block_size: int, margin: int, power_of_2: bool,
                              compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (data, scales) of ``weight_grad_parts``' shapes and dtypes, to trace with,
    each one element into memory of its own: the real ones may lie anywhere in a
    group's buffer, so Inductor must assume no alignment for them (it checks the real
    outputs against what these say)."""
    layout = _layout_of(dtype, tile, block_size, margin, power_of_2)
    return _unaligned_empty(value, value.shape, dtype), _unaligned_empty(
        value, layout.scale_shape(tuple(value.shape)), torch.float32,
    )


def _unaligned_empty(like: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of ``shape`` and ``dtype`` on ``like``'s device that starts one
    element into its memory."""
    return like.new_empty(shape.numel() + 1, dtype=dtype)[1:].view(shape)


class WeightGrad(WeightGradDispatch):
    """The FP8 gradient of an FP8 layer's real weight, as that weight's ``.grad``.

    Args:
        fp8: the FP8 data and its float32 scales (tensorwise, per row or per tile).
        dtype: the dtype the gradient reports: its Parameter's, so autograd does not
            cast it.
        layout: how it is stored (``grad_layout``); results of operations keep it.
    """

    grad_layout: GradLayout

    @staticmethod
    def __new__(cls, fp8: ScaledTensor, dtype: torch.dtype, layout: GradLayout) -> "WeightGrad":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, fp8.shape, dtype=dtype, device=fp8.data.device, requires_grad=False
        )

    def __init__(self, fp8: ScaledTensor, dtype: torch.dtype, layout: GradLayout) -> None:
        self._data, self._scale, self.grad_layout = fp8.data, fp8.scale, layout

    @classmethod
    def from_float(cls, value: torch.Tensor, layout: GradLayout, dtype: torch.dtype,
                   compiled: bool = False, slot: GradSlot | None = None) -> "WeightGrad":
        """The float gradient ``value`` stored at ``layout``, reporting ``dtype``: in
        ``slot`` where it may be claimed (``GradSlot``), else in memory of its own. The
        quantization runs as compiled kernels as ``compiled`` says
        (``amp8._compiled.runs_compiled``), with the same bits. Inside a compiled graph
        only gradients of ``COMPILED_SLOT_MIN_ELEMENTS`` elements or more go to the slot
        (none by default)."""
        if slot is not None and torch.compiler.is_compiling():  # (a slot reaches a graph only where COMPILED_SLOTS)
            if COMPILED_SLOT_MIN_ELEMENTS is not None and value.numel() >= COMPILED_SLOT_MIN_ELEMENTS:
                data, scale = torch.ops.amp8.weight_grad_parts(
                    value, slot, layout.dtype, None if layout.tile is None else list(layout.tile),
                    layout.block_size, layout.margin, layout.power_of_2, compiled,
                )
                return cls(ScaledTensor(data, scale, layout.block_size), dtype, layout)
            slot = None  # quantized inside the graph, copied in at the step
        data, scale = _weight_grad_parts(layout, value, slot, compiled)
        return cls(ScaledTensor(data, scale, layout.block_size), dtype, layout)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], layout: GradLayout, dtype: torch.dtype,
              device: torch.device) -> "WeightGrad":
        """A zero gradient of ``shape`` that holds one byte and one scale (its data is
        one zero expanded): what a sink starts as."""
        data = torch.zeros((), dtype=layout.dtype, device=device).expand(shape)
        scale = torch.ones(layout.scale_shape(shape), device=device)
        return cls(ScaledTensor(data, scale, layout.block_size), dtype, layout)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(FP8 data, scales, block size)`` as ``fp8`` holds them, without building it
        (an optimizer step reads thousands)."""
        return self._data, self._scale, self.grad_layout.block_size

    @property
    def fp8(self) -> ScaledTensor:
        """The FP8 data and scales, sharing their memory (changes show in the gradient)."""
        return ScaledTensor(self._data, self._scale, self.grad_layout.block_size)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, data={self._data.dtype}, "
            f"scale={tuple(self._scale.shape)}, real={self.dequantize()})"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real gradient in ``dtype``."""
        return self.fp8.dequantize(dtype)

    def store_(self, value: torch.Tensor) -> "WeightGrad":
        """Store the float ``value`` here, in place, with fresh scales at this layout."""
        fp8 = self.grad_layout.quantize(value)
        self._data.copy_(fp8.data)
        self._scale.copy_(fp8.scale)
        return self

    def at_rest(self) -> "WeightGrad":
        """This gradient as a ``WeightGrad`` (what ``param.grad`` holds), sharing memory."""
        return WeightGrad(self.fp8, self.dtype, self.grad_layout)

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        """Bytes really held: the FP8 data plus its scales."""
        return self.fp8.nbytes

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """``isfinite`` reads the real values here: its kernel checks the reported dtype
        before the operation reaches ``__torch_dispatch__`` (and knows no FP8 dtype)."""
        if func is torch.isfinite or func is torch.Tensor.isfinite:
            return func(*[arg.dequantize() if isinstance(arg, WeightGrad) else arg for arg in args], **(kwargs or {}))
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


class WeightGradInFlight(WeightGrad):
    """A ``WeightGrad`` that torch.compile can trace: the gradient a compiled backward
    returns, and the sinks it returns it to (see ``amp8.nn.grad_routes``). It becomes
    a ``WeightGrad`` (``at_rest()``) before it reaches a Parameter."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, GradLayout]]:
        """The inner tensors (FP8 data, scales) and what rebuilds the wrapper."""
        return ["_data", "_scale"], (self.dtype, self.grad_layout)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], context: tuple[torch.dtype, GradLayout], outer_size: Any, outer_stride: Any
    ) -> "WeightGradInFlight":
        """The wrapper around ``inner`` (see ``__tensor_flatten__``)."""
        dtype, layout = context
        return WeightGradInFlight(ScaledTensor(inner["_data"], inner["_scale"], layout.block_size), dtype, layout)
