"""How a list of flat tensors is cut into one chunk per rank and packed for collectives.

Tensor ``t`` of ``numel`` elements in rows of ``row_t`` elements is zero-padded to
``world * chunk_t`` elements, with ``chunk_t = ceil(numel / (world * row_t)) * row_t``;
rank ``r`` owns elements ``[r * chunk_t, (r + 1) * chunk_t)``. Rows of one element cut a
tensor as evenly as it goes; rows of a weight's ``in_features`` give each rank the rows
FSDP2's ``fully_shard`` gives it (``torch.chunk`` along dim 0). Packed, the tensors form
a ``(world, columns)`` matrix whose row ``r`` holds rank ``r``'s chunk of every tensor
side by side, so one all-to-all moves every chunk to its owner and one all-gather brings
every owner's chunk back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    """Chunking of tensors with ``numels`` elements over ``world`` ranks, whole rows of
    ``row_sizes`` elements per chunk (one element per row when None)."""

    numels: tuple[int, ...]
    world: int
    row_sizes: tuple[int, ...] | None = None

    @property
    def chunks(self) -> tuple[int, ...]:
        """Elements of each tensor per rank (the last ranks' chunks may be padding)."""
        rows = self.row_sizes or (1,) * len(self.numels)
        return tuple(-(-numel // (self.world * row)) * row for numel, row in zip(self.numels, rows))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Column where each tensor's chunk starts in a packed row."""
        offsets, total = [], 0
        for chunk in self.chunks:
            offsets.append(total)
            total += chunk
        return tuple(offsets)

    @property
    def columns(self) -> int:
        """Width of a packed row: the sum of the chunks."""
        return sum(self.chunks)

    def shard_range(self, index: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s elements of tensor ``index`` (may be empty)."""
        chunk, numel = self.chunks[index], self.numels[index]
        return min(rank * chunk, numel), min((rank + 1) * chunk, numel)

    def pack(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """``(world, columns)``: row ``r`` holds chunk ``r`` of every flat tensor."""
        rows = []
        for flat, chunk in zip(flats, self.chunks):
            padded = torch.cat([flat, flat.new_zeros(self.world * chunk - flat.numel())])
            rows.append(padded.view(self.world, chunk))
        return torch.cat(rows, dim=1)

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of ``pack``: the flat tensors, padding dropped."""
        return [
            packed[:, offset : offset + chunk].reshape(-1)[:numel]
            for offset, chunk, numel in zip(self.offsets, self.chunks, self.numels)
        ]

    def segments(self, row: torch.Tensor) -> list[torch.Tensor]:
        """The per-tensor pieces of one packed row (or of the last dim of a matrix)."""
        return [row[..., offset : offset + chunk] for offset, chunk in zip(self.offsets, self.chunks)]
