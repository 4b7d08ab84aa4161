"""``ScaledTensor``: low-precision data with the scale that gives back its real values.

It is a plain container, not a ``torch.Tensor`` look-alike: code that wants real values
asks for them with ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amp8.quant import scaling


@dataclass(frozen=True)
class ScaledTensor:
    """``data`` holds ``x * scale`` in a low-precision dtype; ``scale`` is float32 (or
    E8M0, read as float32).

    ``scale`` is a scalar for tensorwise scaling, (R, 1) or (1, C) for one scale per row
    or column, and one scale per ``block_size`` elements along any other dimension
    (see ``scaling.expand_scale``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int = 0
    inverse: torch.Tensor | None = None
    """``1 / scale``, what a GEMM is handed, where the cast computed it alongside (None:
    the GEMM computes it)."""

    @classmethod
    def from_float(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype,
        *,
        margin: int = 0,
        power_of_2: bool = False,
        tile: tuple[int, int] | None = None,
    ) -> "ScaledTensor":
        """Quantize ``x`` to ``dtype`` with fresh scales from its own amax: one for the
        tensor, or one per ``tile`` (rows, columns) of a 2-D ``x``."""
        data, scale = scaling.quantize_tiles(x, dtype, tile, margin=margin, power_of_2=power_of_2)
        return cls(data, scale, 0 if tile is None else max(tile))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values, ``data / scale``, in ``dtype``."""
        return scaling.dequantize(self.data, self.full_scale(), dtype)

    def full_scale(self) -> torch.Tensor:
        """The scales broadcast against ``data`` (block scales repeated per element)."""
        return scaling.expand_scale(self.scale.float(), tuple(self.data.shape), self.block_size)

    def t(self) -> "ScaledTensor":
        """The transposed matrix, with its scales transposed alongside."""
        scale, inverse = (t.t() if t is not None and t.dim() == 2 else t for t in (self.scale, self.inverse))
        return ScaledTensor(self.data.t(), scale, self.block_size, inverse)  # type: ignore[arg-type]

    def with_data(self, data: torch.Tensor) -> "ScaledTensor":
        """``data`` with this tensor's scales: the same values in another memory layout
        (or, under one scale per tensor, with zero rows appended)."""
        return ScaledTensor(data, self.scale, self.block_size, self.inverse)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of ``data``."""
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of ``data``."""
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: the data plus its scales."""
        return self.data.nbytes + self.scale.nbytes


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a weight FSDP2 shards over data-parallel ranks)."""
    return hasattr(tensor, "to_local")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this process stores of ``tensor``: the local shard of a ``DTensor`` (see
    ``is_sharded``), or ``tensor`` itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor
