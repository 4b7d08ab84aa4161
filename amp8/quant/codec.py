"""How a float32 tensor is stored: one ``Layout`` with its encode and decode.

A layout names the storage dtype (None: float32 as is), how the scales tile the tensor
(one for the tensor, one per row of a matrix, one per flat block, one per tile of a
matrix), the margin and power-of-two rounding of the scales, the dtype the scales are kept
in (float32, or one-byte E8M0 powers of two) and the noise field a stochastic rounding
takes (``amp8.quant.noise.noise_field``; None rounds to nearest). Adam's moments, O3's
master weights and the FP16 weights of FP8 layers are encoded and decoded here, by the
optimizer's reference step one tensor at a time and by its grouped step over the rows of
flat buffers (``encode_rows`` / ``decode_rows``: the same arithmetic, element for element).

The optimizer saves each stored tensor's layout beside it (``to_state`` / ``from_state``:
plain ints and strings, which ``torch.load(weights_only=True)`` reads), so a checkpoint
decodes as it was saved, whatever the shapes of its scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from amp8.quant import scaling
from amp8.quant.noise import noise_field


class Tiling(str, Enum):
    """Which elements share a scale."""

    TENSOR = "tensor"  # one scale, shape ()
    ROWS = "rows"  # one per row of a matrix, shape (R, 1)
    BLOCKS = "blocks"  # one per flat block of ``block`` elements, shape (ceil(n / block),)
    TILES = "tiles"  # one per ``tile`` of a matrix, shape (ceil(R / r), ceil(C / c))


_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
)}


@dataclass(frozen=True)
class Layout:
    """How one tensor is stored (see the module docstring)."""

    dtype: torch.dtype | None = None
    tiling: Tiling = Tiling.TENSOR
    block: int = 0  # BLOCKS: elements per block
    tile: tuple[int, int] | None = None  # TILES: (rows, columns)
    margin: int = 0
    power_of_2: bool = False
    scale_dtype: torch.dtype = torch.float32
    stream: int | None = None  # stochastic rounding's noise field; None: to nearest

    @classmethod
    def for_tile(
        cls, dtype: torch.dtype, tile: tuple[int, int] | None, shape: tuple[int, ...], *, margin: int = 0,
        power_of_2: bool = False, scale_dtype: torch.dtype = torch.float32, stream: int | None = None,
    ) -> "Layout":
        """The layout of a tensor of ``shape`` with one scale per ``tile`` (rows, columns):
        one scale for the tensor where ``tile`` is None, one per row where a tile is a whole
        row of a matrix (float32 scales), else one per tile."""
        if tile is None:
            tiling = Tiling.TENSOR
        elif len(shape) == 2 and tuple(tile) == (1, shape[1]) and scale_dtype == torch.float32:
            tiling, tile = Tiling.ROWS, None
        else:
            tiling = Tiling.TILES
        return cls(dtype, tiling, tile=tile, margin=margin, power_of_2=power_of_2, scale_dtype=scale_dtype,
                   stream=stream)

    @classmethod
    def of_saved(cls, data: torch.Tensor, scale: torch.Tensor, block: int) -> "Layout":
        """The layout of a saved weight's ``data`` and ``scale``, where the checkpoint
        records only its ``block`` size: a dimension with one scale is one whole tile, one
        with a scale per element a tile of 1, any other a tile of ``block`` (``decode``
        checks that the scales tile the data).

        Raises:
            ValueError: scales (more than one) of another number of dimensions than the data.
        """
        if scale.dim() == 0:
            return cls(data.dtype, scale_dtype=scale.dtype)
        if scale.dim() != data.dim():
            raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit saved data of shape {tuple(data.shape)}")
        tile = tuple(1 if count == size else size if count == 1 else block for count, size in zip(scale.shape, data.shape))
        return cls.for_tile(data.dtype, tile, tuple(data.shape), scale_dtype=scale.dtype)  # type: ignore[arg-type]

    @property
    def scaled(self) -> bool:
        """Whether the data carry scales (a low-precision dtype)."""
        return self.dtype is not None

    @property
    def per_tensor(self) -> bool:
        """Whether one scale serves the whole tensor."""
        return self.scaled and self.tiling is Tiling.TENSOR

    @property
    def per_row(self) -> bool:
        """Whether a grouped step keeps one scale per buffer row (rows of a matrix, or
        flat blocks of the buffer's width)."""
        return self.tiling in (Tiling.ROWS, Tiling.BLOCKS)

    # -- one tensor ---------------------------------------------------------------------
    def amaxes(self, values: torch.Tensor) -> torch.Tensor:
        """The absolute maximum of each group of ``values`` that shares a scale, in the
        shape of the scales."""
        if self.tiling is Tiling.TENSOR:
            return scaling.amax(values)
        if self.tiling is Tiling.ROWS:
            return values.detach().float().abs().amax(dim=-1, keepdim=True)
        if self.tiling is Tiling.BLOCKS:
            return scaling.as_blocks(values.detach().float().abs(), self.block).amax(dim=1)
        return scaling.tile_amax(values, self.tile)

    def scales(self, amax: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """float32 scales that map ``amax`` to the dtype's largest value (with the margin
        and power-of-two rounding); ``previous`` where an amax is zero or not finite."""
        assert self.dtype is not None
        return scaling.scale_from_amax(amax, self.dtype, margin=self.margin, power_of_2=self.power_of_2,
                                       previous=previous)

    def encode(
        self,
        values: torch.Tensor,
        scale: torch.Tensor | None = None,
        words: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(data, scales)`` storing float ``values``: with ``scale`` where given, else
        scales from the values' own amaxes (``previous`` where an amax is zero);
        stochastically under ``words`` (``amp8.quant.noise.update_words`` of each element)
        where the layout has a noise stream, else to nearest. Scales come back as
        ``scale_dtype``; None for float32 storage."""
        if self.dtype is None:
            return values.float(), None
        if scale is None:
            previous = previous if previous is None or previous.shape == self._scale_shape(values) else None
            scale = self.scales(self.amaxes(values), None if previous is None else previous.float())
        data = self._quantize(values, self._expand(scale, values), words)
        return data, scale.to(self.scale_dtype)

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The float32 values of ``encode``'s ``(data, scales)``."""
        if self.dtype is None or scale is None:
            return data.float()
        if self.tiling is Tiling.BLOCKS:
            return scaling.dequantize_blockwise(data, scale.float(), self.block, power_of_2=self.power_of_2)
        return scaling.dequantize(data, self._expand(scale.float(), data), power_of_2=self.power_of_2)

    def _quantize(self, values: torch.Tensor, full_scale: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
        assert self.dtype is not None
        if self.tiling is Tiling.BLOCKS:
            blocks = scaling.as_blocks(values.float(), self.block)
            noise_words = None if words is None else scaling.as_blocks(words, self.block)
            data = self._quantize_flat(blocks, full_scale, noise_words)
            return data.flatten()[: values.numel()].view(values.shape)
        return self._quantize_flat(values, full_scale, words)

    def _quantize_flat(self, values: torch.Tensor, scale: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
        assert self.dtype is not None
        if self.stream is None or words is None:
            return scaling.quantize(values, scale, self.dtype)
        field = noise_field(words, self.stream, scaling.dropped_bits(self.dtype))
        return scaling.quantize_with_noise(values, scale, self.dtype, field)

    def _expand(self, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``scale`` broadcast against ``like`` (as blocks, for BLOCKS)."""
        if self.tiling is Tiling.BLOCKS:
            return scale[:, None]
        if self.tiling is Tiling.TILES:
            assert self.tile is not None
            # The tile is of the last two dimensions (each matrix of a stack of experts').
            repeated = [t for t, count, size in zip(self.tile, scale.shape[-2:], like.shape[-2:])
                        if count not in (1, size)]
            return scaling.expand_scale(scale, tuple(like.shape), max(repeated) if repeated else 1)
        return scale

    def _scale_shape(self, values: torch.Tensor) -> torch.Size:
        return self.amaxes(torch.empty(values.shape, device="meta")).shape

    # -- rows of a group's buffer (amp8.optim.group_step) --------------------------------
    def decode_rows(self, data: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
        """float32 values of a (rows, width) buffer whose scales are given per row (rows, 1)."""
        if self.dtype is None or row_scale is None:
            return data.float()
        return scaling.dequantize(data, row_scale, power_of_2=self.power_of_2)

    def encode_rows(self, values: torch.Tensor, row_scale: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
        """The data of a (rows, width) buffer of float32 ``values``, each row with its
        scale in ``row_scale`` (rows, 1): as ``encode`` stores each element."""
        return self._quantize_flat(values, row_scale, words)

    # -- checkpoints -----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """The layout as plain values, for an optimizer's state dict."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, Tiling):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> "Layout":
        """The layout ``to_state`` saved."""
        values = dict(saved)
        for name in ("dtype", "scale_dtype"):
            if values.get(name) is not None:
                values[name] = _DTYPES[values[name]]
        values["tiling"] = Tiling(values.get("tiling", "tensor"))
        if values.get("tile") is not None:
            values["tile"] = tuple(values["tile"])
        return cls(**values)


FLOAT32 = Layout()
"""float32 as is: no scales."""
