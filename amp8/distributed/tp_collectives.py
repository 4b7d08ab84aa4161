"""The collectives of tensor parallelism, as autograd Functions over one process group.

Each Function is one collective and its adjoint: an all-reduce whose backward is the
identity (the partial sums of a row-parallel layer), the identity whose backward is an
all-reduce (a replicated input feeding sharded weights), an all-gather whose backward
keeps this rank's chunk, a reduce-scatter whose backward is an all-gather, and the
sequence-parallel all-gather whose backward is a reduce-scatter, in FP8 on the wire
(``Fp8GatherDim``). They receive tensors and a small frozen ``GroupComm``, never a layer.

Bytes are counted in the ``GroupComm``'s ``WireStats`` as the ring algorithms move them,
per rank: an all-gather sends its chunk to ``world - 1`` ranks, a reduce-scatter
``(world - 1) / world`` of its input, an all-reduce twice that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from amp8.distributed.fp8_collectives import WireStats
from amp8.quant import scaling
from amp8.nn.quantizer import CastRule


@dataclass(frozen=True, eq=False)
class GroupComm:
    """A tensor-parallel process group and the counter of its bytes on the wire.

    Attributes:
        group: the tensor-parallel group.
        world: ranks in the group.
        rank: this rank's index in the group.
        stats: where each collective adds the bytes this rank sends, by kind; None
            counts nothing.
    """

    group: dist.ProcessGroup
    world: int
    rank: int
    stats: WireStats | None = None

    @classmethod
    def over(cls, group: dist.ProcessGroup, stats: WireStats | None = None) -> "GroupComm":
        """The ``GroupComm`` of ``group`` for this rank."""
        return cls(group, dist.get_world_size(group), dist.get_rank(group), stats)

    def count(self, kind: str, nbytes: float) -> None:
        """Add ``nbytes`` sent by a collective of ``kind`` to ``stats``."""
        if self.stats is not None:
            self.stats.add(kind, int(nbytes))


def all_reduce(x: torch.Tensor, comm: GroupComm, kind: str = "all_reduce") -> torch.Tensor:
    """The sum of ``x`` over the group, in a new tensor."""
    total = x.contiguous().clone()
    dist.all_reduce(total, group=comm.group)
    comm.count(kind, 2 * total.nbytes * (comm.world - 1) / comm.world)
    return total


def all_gather(x: torch.Tensor, dim: int, comm: GroupComm, kind: str = "all_gather") -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (FP8 moves as bytes:
    gloo and NCCL have no FP8 dtype)."""
    raw = x.contiguous()
    is_fp8 = raw.element_size() == 1 and raw.dtype.is_floating_point
    wire = raw.view(torch.uint8) if is_fp8 else raw
    pieces = [torch.empty_like(wire) for _ in range(comm.world)]
    dist.all_gather(pieces, wire, group=comm.group)
    comm.count(kind, wire.nbytes * (comm.world - 1))
    gathered = torch.cat(pieces, dim=dim)
    return gathered.view(raw.dtype) if is_fp8 else gathered


def reduce_scatter(x: torch.Tensor, dim: int, comm: GroupComm, kind: str = "reduce_scatter") -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum of ``x`` over the group."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm.world, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=comm.group)
    comm.count(kind, moved.nbytes * (comm.world - 1) / comm.world)
    return out.movedim(0, dim)


def local_chunk(x: torch.Tensor, dim: int, comm: GroupComm) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a copy)."""
    return x.chunk(comm.world, dim)[comm.rank].contiguous()


class CopyToGroup(torch.autograd.Function):
    """``apply(x, comm)``: ``x`` as it is; backward sums the gradient over the group (a
    replicated tensor whose uses on each rank see part of the gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: GroupComm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_reduce(grad, ctx.comm, "all_reduce_backward"), None


class ReduceFromGroup(torch.autograd.Function):
    """``apply(x, comm)``: the sum of the partial ``x`` over the group; backward passes
    the (replicated) gradient on as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: GroupComm) -> torch.Tensor:  # type: ignore[override]
        return all_reduce(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class GatherDim(torch.autograd.Function):
    """``apply(x, dim, comm)``: the ranks' ``x`` concatenated along ``dim``; backward
    keeps this rank's chunk of the gradient (a replicated result)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, comm: GroupComm) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.comm = dim, comm
        return all_gather(x, dim, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return local_chunk(grad, ctx.dim, ctx.comm), None, None


class _GatheredBackward(torch.autograd.Function):
    """A Function of ``(x, dim, comm)`` that leaves each rank a chunk along ``dim``:
    backward gathers the gradient's chunks."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return all_gather(grad, ctx.dim, ctx.comm, "all_gather_backward"), None, None


class ChunkDim(_GatheredBackward):
    """``apply(x, dim, comm)``: this rank's chunk of the replicated ``x`` along ``dim``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, comm: GroupComm) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.comm = dim, comm
        return local_chunk(x, dim, comm)


class ReduceScatterDim(_GatheredBackward):
    """``apply(x, dim, comm)``: this rank's chunk along ``dim`` of the sum of the partial
    ``x`` over the group (a row-parallel layer's output, sequence parallel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, comm: GroupComm) -> torch.Tensor:  # type: ignore[override]
        ctx.dim, ctx.comm = dim, comm
        return reduce_scatter(x, dim, comm)


class GatherSequence(torch.autograd.Function):
    """``apply(x, dim, comm, rule)``: the sequence-sharded ``x`` gathered along ``dim``
    (sequence parallel, before a column-parallel layer); backward reduce-scatters the
    gradient, since every rank's layer used every token.

    With a ``CastRule`` (``rule``, the layer's input cast, not microscaled), ``x`` goes
    over the wire in its FP8 format: each rank casts its tokens with scales the ranks
    agree on (one scale from the amax over the group under one scale per tensor, one
    per token otherwise, which travel with the tokens) and the gathered bytes are
    dequantized to ``x``'s dtype. Under power-of-two scales the layer's own cast of the
    result gives back the same FP8 bytes. Without one (None), ``x`` moves as it is.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, dim: int, comm: GroupComm, rule: CastRule | None, tensorwise: bool
    ) -> torch.Tensor:
        ctx.dim, ctx.comm = dim, comm
        if rule is None:
            return all_gather(x, dim, comm, "all_gather_sequence")
        data, scale = _wire_cast(x, comm, rule, tensorwise)
        data = all_gather(data, dim, comm, "all_gather_sequence")
        if not tensorwise:  # one scale per token, gathered with the tokens
            scale = all_gather(scale, dim, comm, "all_gather_sequence")
        return scaling.dequantize(data, scale, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        return reduce_scatter(grad, ctx.dim, ctx.comm, "reduce_scatter_backward"), None, None, None, None


def _wire_cast(
    x: torch.Tensor, comm: GroupComm, rule: CastRule, tensorwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``rule``'s FP8 dtype and its scales: one scale from the amax over the
    group (an all-reduce MAX of one float), or one per token (shape ``x.shape[:-1] + (1,)``)."""
    if tensorwise:
        amax = scaling.amax(x).reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=comm.group)
        comm.count("amax_all_reduce", 2 * amax.nbytes * (comm.world - 1) / comm.world)
        scale = rule.scale_from_amax(amax.reshape(()), None)
    else:
        scale = rule.scale_from_amax(x.detach().abs().amax(dim=-1, keepdim=True).float(), None)
    return scaling.quantize(x, scale, rule.dtype), scale
