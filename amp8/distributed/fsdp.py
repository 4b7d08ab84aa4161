"""O3's FP8 weights sharded over data-parallel ranks by FSDP2 (``fully_shard``).

FSDP2 keeps each rank's rows of every FP8 layer's weight, and each rank's experts of
both weight stacks of a mixture of experts (FP8 data; the scales are replicated
buffers), and all-gathers the full FP8 weight before the layer's forward and backward,
freeing it after. amp8 keeps everything else: the FP8 weight gradients never reach
``param.grad`` (which FSDP2 would reduce-scatter in the gradient's own dtype), so the
optimizer's ``GradientBuckets`` reduce-scatter them in FP8 to the rows each rank holds,
and the optimizer writes each rank's rows of the new FP8 weight in place, with the
whole weight's scales (one, or one per expert) from the amaxes over all ranks. Biases
and parameters outside FP8 layers stay replicated and are averaged by the buckets too.

FSDP2 all-gathers each weight through ``Fp8WeightShard`` (its public all-gather
extension for tensor subclasses): the FP8 bytes travel as uint8 (gloo has no FP8 dtype)
and are counted in the run's ``WireStats``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from amp8.distributed.data_parallel import DataParallelGroup
from amp8.distributed.weight_shard import Fp8WeightShard
from amp8.nn.stored_weights import StoredWeightsBase


def shard_weights(model: nn.Module, layers: Iterable[StoredWeightsBase], data_parallel: DataParallelGroup) -> None:
    """Apply ``fully_shard`` to each of ``layers`` for its stored weights alone (an
    ``Fp8Linear``'s ``weight``, an ``Fp8Experts``' two stacks, which FSDP2 splits by
    expert), and to ``model`` for none of its parameters (the root that runs FSDP2's
    end-of-backward work); every other parameter stays a plain, replicated tensor. Each
    layer is then told (``mark_weights_sharded``).

    Each stored weight becomes a new ``nn.Parameter`` holding a ``DTensor`` of this
    rank's rows, an ``Fp8WeightShard`` (which all-gathers as bytes and counts them in
    ``data_parallel.stats``): read it from the layer after this call.
    """
    layers = list(layers)
    device_type = next(iter(model.parameters())).device.type
    group = data_parallel.group if data_parallel.group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device_type)
    sharded = set()
    for layer in layers:
        handles = layer.stored_weights()
        names = [handle.name for handle in handles]
        for handle in handles:  # FSDP2 shards the stored FP8 data, which the sharded Parameter holds from now on
            setattr(layer, handle.name, nn.Parameter(
                Fp8WeightShard(handle.data, data_parallel.stats), requires_grad=handle.param.requires_grad
            ))
        others = {param for name, param in layer.named_parameters() if name not in names}
        fully_shard(layer, mesh=mesh, ignored_params=others)
        sharded.update(id(getattr(layer, name)) for name in names)
    if all(layer is not model for layer in layers):
        fully_shard(model, mesh=mesh, ignored_params={p for p in model.parameters() if id(p) not in sharded})
    for layer in layers:
        layer.mark_weights_sharded()
