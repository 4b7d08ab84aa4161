"""Data parallelism for amp8 models: FP8 gradient averaging and O3's sharded state.

``initialize`` in a process group of more than one rank broadcasts rank 0's parameters
and buffers, and gives the optimizer a ``DataParallelGroup``; the optimizer's
``GradientBuckets`` average every gradient over the ranks with FP8 on the wire (only the
FP8 weights' once the user's DDP is registered with ``register_ddp``, see ``ddp.py``). At
O3 the FP8 weights are sharded by FSDP2 (``fsdp.py``), and
their gradients are reduce-scattered: each rank gets the mean of the rows whose FP8
weights, master weights and moments it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from amp8.distributed.fp8_collectives import WireStats
from amp8.distributed.layout import ShardLayout
from amp8.nn.stored_weights import compact_state_dict
from amp8.tensor.stored import StoredWeight


def row_size(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per row (dim 0) of a tensor of ``shape``, the unit a shard holds whole."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def process_group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when None), or 1 outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def broadcast_module(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's parameters and persistent buffers (what the compact ``state_dict``
    holds: FP8 layers' weights as stored, with their scales) to every rank, as DDP does
    at wrap; FP8 tensors travel as their bytes."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad(), compact_state_dict(model):
        state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for tensor in state.values():
            data = tensor.data
            if data.element_size() == 1 and data.is_floating_point():
                data = data.view(torch.uint8)
            dist.broadcast(data, src=source, group=group)


@dataclass
class DataParallelGroup:
    """The process group of a data-parallel amp8 run and what it sent.

    Attributes:
        group: the process group (None: the default group).
        stats: bytes this rank sent, by collective.
        ddp: the user's ``DistributedDataParallel`` around the model, once registered
            (``amp8.distributed.register_ddp``): it averages every gradient but the FP8
            weights'.
        backward_sync: False while the next backward is inside the DDP's ``no_sync()``.
        at_backward_end: what runs when a backward of the DDP's model ends, on every
            rank, under ``find_unused_parameters=True`` (the reductions' ``synchronize``).
        comm_hook_in_flight: the DDP buckets whose FP8 all-to-all
            ``amp8.distributed.fp8_compress_hook`` started and whose all-gather it starts
            at its next call (see ``amp8.distributed.ddp``).
    """

    group: dist.ProcessGroup | None = None
    stats: WireStats = field(default_factory=WireStats)
    ddp: Any = None
    backward_sync: bool = True
    at_backward_end: list[Callable[[], None]] = field(default_factory=list)
    comm_hook_in_flight: list[Any] = field(default_factory=list)

    def __deepcopy__(self, memo: dict[int, Any]) -> "DataParallelGroup":
        """This same group, not a copy: a process group cannot be copied, and what
        ``copy.deepcopy`` reaches it through (a copied DDP's hooks and comm-hook record)
        belongs to the run it counts. Those hooks act for the registered ``ddp`` only, so
        in a copy they do nothing; a copy of the model itself holds no group (see
        ``amp8.distributed.ddp.DdpGuard``)."""
        return self

    @property
    def reduces_at_backward_end(self) -> bool:
        """Whether the FP8 weights' gradients are averaged when backward ends rather than
        as they become ready: under the user's DDP with ``find_unused_parameters=True``,
        where ranks may leave different weights without a gradient (LayerDrop, MoE
        routing), so only the end of backward comes in the same order on every rank."""
        return self.ddp is not None and bool(getattr(self.ddp, "find_unused_parameters", False))

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


def agree_on_delayed_scales(data_parallel: DataParallelGroup | None, weights: list[StoredWeight]) -> None:
    """Under delayed scaling, every rank takes the largest amaxes (and the smallest scales)
    of all ranks into its layers' histories, in one all-reduce: from the next step all
    ranks cast with the same scales, and every rank's checkpoint holds the same ones.
    Current scaling takes scales from the tensor at hand and needs none of this."""
    states = [state for handle in weights if (state := handle.delayed_scaling_state()) is not None]
    if data_parallel is None or not states:
        return
    packed = torch.cat([torch.cat([history.flatten(), -scale]) for history, scale in states])
    agreed = data_parallel.max_over_ranks(packed)
    sizes = [size for history, scale in states for size in (history.numel(), scale.numel())]
    pieces = agreed.split(sizes)
    for (history, scale), new_history, negated_scale in zip(states, pieces[::2], pieces[1::2]):
        history.copy_(new_history.view_as(history))
        scale.copy_(-negated_scale)
