"""O3's FP8 weights sharded over data-parallel ranks by FSDP2 (``fully_shard``).

FSDP2 keeps each rank's rows of every FP8 layer's weight (FP8 data; the scale is a
replicated buffer) and all-gathers the full FP8 weight before the layer's forward and
backward, freeing it after. amp8 keeps everything else: the layers' FP8 weight gradients
never reach ``param.grad`` (which FSDP2 would reduce-scatter in the gradient's own dtype),
so the optimizer's ``GradientBuckets`` reduce-scatter them in FP8 to the rows each rank
holds, and the optimizer writes each rank's rows of the new FP8 weight in place, with one
scale from the amax over all ranks. Biases and parameters outside FP8 layers stay
replicated and are averaged by the buckets too.

The all-gather moves the FP8 bytes as uint8 (gloo has no FP8 dtype) and counts them in the
run's ``WireStats``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .data_parallel import DataParallel
from .fp8_collectives import WireStats


class ByteAllGather(AllGather):
    """FSDP2's all-gather with its buffers viewed as bytes, so FP8 shards travel over any
    backend unchanged; counts what this rank sends (its shard to every other rank)."""

    def __init__(self, stats: WireStats) -> None:
        self.stats = stats

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer for the gathered bytes."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        """All-gather ``input_tensor`` from every rank into ``output_tensor``."""
        self.stats.add("all_gather", input_tensor.nbytes * (dist.get_world_size(group) - 1))
        return dist.all_gather_single(
            output_tensor.view(torch.uint8), input_tensor.view(torch.uint8), group=group, async_op=async_op
        )


def shard_weights(model: nn.Module, layers: Iterable[nn.Module], data_parallel: DataParallel) -> None:
    """Apply ``fully_shard`` to each of ``layers`` for its ``weight`` alone, and to
    ``model`` for none of its parameters (the root that runs FSDP2's end-of-backward
    work); every other parameter stays a plain, replicated tensor.

    Each layer's ``weight`` becomes a new ``nn.Parameter`` holding a ``DTensor`` of this
    rank's rows: read it from the layer after this call.
    """
    layers = list(layers)
    device_type = next(iter(model.parameters())).device.type
    group = data_parallel.group if data_parallel.group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device_type)
    all_gather = ByteAllGather(data_parallel.stats)
    sharded = set()
    for layer in layers:
        others = {param for name, param in layer.named_parameters() if name != "weight"}
        fully_shard(layer, mesh=mesh, ignored_params=others)
        layer.set_custom_all_gather(all_gather)
        sharded.add(id(layer.weight))
    if all(layer is not model for layer in layers):
        fully_shard(model, mesh=mesh, ignored_params={p for p in model.parameters() if id(p) not in sharded})
