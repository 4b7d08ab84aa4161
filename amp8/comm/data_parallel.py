"""Data parallelism for amp8 models: FP8 gradient averaging and O3's sharded state.

amp8 does not wrap the model in DDP (its reducer reads ``param.grad``, and the weight
gradients of FP8 layers live on the layers in FP8). ``initialize`` in a process group of
more than one rank broadcasts rank 0's parameters and buffers, and gives the optimizer a
``DataParallel``; the optimizer's ``GradientBuckets`` average every gradient over the
ranks with FP8 on the wire. At O3 the FP8 weights are sharded by FSDP2 (``fsdp.py``), and
their gradients are reduce-scattered: each rank gets the mean of the rows whose FP8
weights, master weights and moments it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .fp8_collectives import WireStats
from .layout import ShardLayout


def row_size(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per row (dim 0) of a tensor of ``shape``, the unit a shard holds whole."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def process_group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when None), or 1 outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def broadcast_module(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's parameters and persistent buffers (what ``state_dict`` holds) to every
    rank, as DDP does at wrap; FP8 tensors travel as their bytes."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            data = tensor.data
            if data.element_size() == 1 and data.is_floating_point():
                data = data.view(torch.uint8)
            dist.broadcast(data, src=source, group=group)


@dataclass
class DataParallel:
    """The process group of a data-parallel amp8 run and what it sent.

    Attributes:
        group: the process group (None: the default group).
        stats: bytes this rank sent, by collective.
    """

    group: dist.ProcessGroup | None = None
    stats: WireStats = field(default_factory=WireStats)

    @property
    def world(self) -> int:
        """Number of ranks."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return dist.get_rank(self.group)

    def present_anywhere(self, present: list[bool]) -> list[bool]:
        """For each flag, whether it is True on any rank (e.g. which gradients exist)."""
        return [bool(flag) for flag in self.max_over_ranks(torch.tensor(present, dtype=torch.float32))]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        return self.present_anywhere([flag])[0]

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``values`` over ranks (float32 on the wire: 4 bytes each)."""
        values = values.float().clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        self.stats.add("all_reduce", 2 * values.nbytes * (self.world - 1) // self.world)
        return values

    def shard_range(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        """``[start, end)`` of the flat elements of this rank's rows of a tensor of
        ``shape``: the rows FSDP2 gives this rank."""
        layout = ShardLayout((math.prod(shape),), self.world, (row_size(shape),))
        return layout.shard_range(0, self.rank)
