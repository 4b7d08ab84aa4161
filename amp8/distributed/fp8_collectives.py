"""FP8 collectives over stock ``torch.distributed`` (NCCL or gloo).

Neither backend can sum FP8, so a reduction sends FP8 and sums in float32 (DESIGN.md):

1. each rank packs its float32 values into one chunk per rank (``ShardLayout``) and
   casts every (chunk, tensor) piece to E4M3 with its own scale;
2. an all-to-all sends chunk ``r`` of every rank to rank ``r``, with the scales;
3. rank ``r`` dequantizes what it received and sums it in float32 in rank order:
   that is the reduce-scatter; the mean divides by the world size;
4. for an all-reduce, rank ``r`` casts its summed chunk back to E4M3 with fresh scales
   and an all-gather gives every rank every chunk, so all ranks dequantize the same bytes
   and get bit-identical results.

Every piece carries its own scale, so a rank with large values cannot push another's
into overflow, and an inf or NaN on any rank reaches every rank as NaN. ``WireStats``
counts the bytes each rank hands to other ranks. The all-to-all and the all-gather each
have a ``start_*`` form that returns what is in flight (``wait()`` finishes it), so the
gradient buckets and DDP's comm hook overlap them with backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from amp8.config.formats import E4M3
from amp8.distributed.layout import ShardLayout
from amp8.quant import scaling

WIRE_DTYPE = E4M3
"""Per-piece scales remove the need for E5M2's range; E4M3 keeps one more mantissa bit."""


@dataclass
class WireStats:
    """Bytes this rank sent to other ranks, by collective, as their algorithms move them:
    all-to-all sends all but its own chunk, all-gather sends its chunk to every other rank
    (a ring), all-reduce sends ``2 (world - 1) / world`` of the tensor (a ring)."""

    bytes_by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` sent by a collective of ``kind``."""
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + int(nbytes)

    @property
    def total(self) -> int:
        """All bytes counted."""
        return sum(self.bytes_by_kind.values())


def _quantize_pieces(packed: torch.Tensor, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes of ``packed`` (rows x columns) and float32 scales (rows x tensors), one
    scale per (row, tensor) piece."""
    datas, scales = [], []
    for piece in layout.segments(packed):
        scale = scaling.scale_from_amax(piece.abs().amax(dim=-1), WIRE_DTYPE)
        datas.append(scaling.quantize(piece, scale[..., None], WIRE_DTYPE))
        scales.append(scale)
    return torch.cat(datas, dim=-1), torch.stack(scales, dim=-1)


def _dequantize_pieces(data: torch.Tensor, scales: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    pieces = [
        scaling.dequantize(piece, scales[..., index, None])
        for index, piece in enumerate(layout.segments(data))
    ]
    return torch.cat(pieces, dim=-1)


def _byte_view(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


@dataclass
class PendingReduceScatter:
    """An FP8 all-to-all in flight; ``wait()`` finishes the reduce-scatter."""

    layout: ShardLayout
    received_data: torch.Tensor
    received_scales: torch.Tensor
    works: list[dist.Work]

    def wait(self) -> torch.Tensor:
        """This rank's packed row of means over ranks (``layout.columns`` float32 values)."""
        for work in self.works:
            work.wait()
        values = _dequantize_pieces(self.received_data.view(WIRE_DTYPE), self.received_scales, self.layout)
        return values.sum(dim=0) / self.layout.world


def start_reduce_scatter_mean(
    flats: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    stats: WireStats | None = None,
    row_sizes: tuple[int, ...] | None = None,
) -> PendingReduceScatter:
    """Cast ``flats`` to per-piece-scaled E4M3 and start the all-to-all (asynchronous);
    ``row_sizes`` keeps each rank's chunk to whole rows (see ``ShardLayout``)."""
    world = dist.get_world_size(group)
    layout = ShardLayout(tuple(flat.numel() for flat in flats), world, row_sizes)
    data, scales = _quantize_pieces(layout.pack([flat.float() for flat in flats]), layout)
    received_data = torch.empty_like(_byte_view(data))
    received_scales = torch.empty_like(scales)
    works = [
        dist.all_to_all_single(received_data, _byte_view(data), group=group, async_op=True),
        dist.all_to_all_single(received_scales, scales, group=group, async_op=True),
    ]
    if stats is not None:
        stats.add("all_to_all", (data.nbytes + scales.nbytes) * (world - 1) // world)
    return PendingReduceScatter(layout, received_data, received_scales, works)


def fp8_reduce_scatter_mean(
    flats: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    stats: WireStats | None = None,
) -> tuple[ShardLayout, torch.Tensor]:
    """Mean over ranks of float32 ``flats``, each rank getting its own chunk of each.

    Returns the layout and this rank's packed row of means (``columns`` float32 values).
    """
    pending = start_reduce_scatter_mean(flats, group, stats)
    return pending.layout, pending.wait()


@dataclass
class PendingAllGather:
    """An FP8 all-gather in flight; ``wait()`` (or, once ``future()`` completes,
    ``result()``) gives the gathered float32 tensors."""

    layout: ShardLayout
    gathered_data: list[torch.Tensor]
    gathered_scales: list[torch.Tensor]
    works: list[dist.Work]

    def future(self) -> torch.futures.Future[list[torch.futures.Future[Any]]]:
        """A future that completes when every collective of the all-gather has."""
        return torch.futures.collect_all([work.get_future() for work in self.works])

    def result(self) -> list[torch.Tensor]:
        """The flat float32 tensors, identical on every rank; call once the collectives
        are complete (after ``future()`` completes, or from ``wait()``)."""
        packed = _dequantize_pieces(
            torch.stack(self.gathered_data).view(WIRE_DTYPE), torch.stack(self.gathered_scales), self.layout
        )
        return self.layout.unpack(packed)

    def wait(self) -> list[torch.Tensor]:
        """Wait for the collectives; the flat float32 tensors (see ``result``)."""
        for work in self.works:
            work.wait()
        return self.result()


def start_all_gather(
    row: torch.Tensor,
    layout: ShardLayout,
    group: dist.ProcessGroup | None = None,
    stats: WireStats | None = None,
) -> PendingAllGather:
    """Cast this rank's packed float32 ``row`` to E4M3 with per-tensor scales and start
    the all-gather of every rank's row (asynchronous)."""
    world = layout.world
    data, scales = _quantize_pieces(row[None], layout)
    gathered_data = [torch.empty_like(_byte_view(data[0])) for _ in range(world)]
    gathered_scales = [torch.empty_like(scales[0]) for _ in range(world)]
    works = [
        dist.all_gather(gathered_data, _byte_view(data[0]), group=group, async_op=True),
        dist.all_gather(gathered_scales, scales[0], group=group, async_op=True),
    ]
    if stats is not None:
        stats.add("all_gather", (data.nbytes + scales.nbytes) * (world - 1))
    return PendingAllGather(layout, gathered_data, gathered_scales, works)


def fp8_all_gather(
    row: torch.Tensor,
    layout: ShardLayout,
    group: dist.ProcessGroup | None = None,
    stats: WireStats | None = None,
) -> list[torch.Tensor]:
    """Every rank's packed float32 ``row`` sent as E4M3 with per-tensor scales; returns
    the flat float32 tensors, identical on every rank."""
    return start_all_gather(row, layout, group, stats).wait()


def fp8_all_reduce_mean(
    flats: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    stats: WireStats | None = None,
) -> list[torch.Tensor]:
    """Mean over ranks of float32 ``flats``, moved in FP8; bit-identical on every rank."""
    layout, row = fp8_reduce_scatter_mean(flats, group, stats)
    return fp8_all_gather(row, layout, group, stats)
