"""Tensor parallelism for amp8's FP8 layers: parallel styles for torch's
``parallelize_module``.

``Fp8ColwiseParallel`` and ``Fp8RowwiseParallel`` shard an ``Fp8Linear`` (or a plain
``nn.Linear``, such as a head amp8 kept in high precision) in place: each rank's layer
keeps its own rows (column-parallel: a slice of ``out_features``) or columns
(row-parallel: a slice of ``in_features``) of the stored weight, as plain tensors in the
same Parameter at the same scale, and forward hooks insert the collectives, each an
autograd Function with its adjoint (``tp_collectives``). Weights do not become DTensors:
amp8's stored weight (FP16 ``w * scale``) and its FP8 gradient stay what the optimizer,
clipping and checkpoints already read, and the layer's GEMMs run on local shards.

What must agree over the tensor-parallel group, and what need not:

- Sequence parallel gathers each rank's tokens in FP8 into one operand. Under one scale
  per tensor every rank casts with the scale of the amax over the group (one all-reduce
  MAX of a float), as correctness needs; finer scales travel with their tokens.
- Every other FP8 cast is local and needs no agreement: a column-parallel layer's weight
  rows and output gradient columns each feed their own output columns, and a row-parallel
  layer's input columns and weight columns feed a partial product that the GEMM
  dequantizes before the partials are summed in high precision. Their scales come from
  the local shard's amax, never larger than the whole tensor's, so the shards are cast
  at least as finely as the one-process run casts them; agreeing (an all-reduce MAX per
  cast) would only reproduce the one-process run's bytes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from amp8.config.levels import Precision
from amp8.distributed.fp8_collectives import WireStats
from amp8.distributed.tp_collectives import (
    ChunkDim, CopyToGroup, GatherDim, GatherSequence, GroupComm, ReduceFromGroup, ReduceScatterDim,
)
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import CastRule
from amp8.quant.scale_layout import GEMM_ALIGNMENT


class Fp8ColwiseParallel(ParallelStyle):
    """Shard a linear layer column-wise (its ``out_features``) over a 1-D device mesh.

    The layer's input is replicated (``Replicate()``, the default; backward sums its
    gradient over the ranks) or sharded along the sequence (``Shard(1)``, sequence
    parallel: gathered before the layer, in FP8 on the wire for an ``Fp8Linear``; backward
    reduce-scatters its gradient). The output is this rank's slice of the last dim
    (``Shard(-1)``, the default) or gathered whole (``Replicate()``). The bias is
    sharded with the weight's rows.

    Args:
        input_layouts: ``Replicate()`` or ``Shard(d)`` for a dim ``d`` other than the last.
        output_layouts: ``Shard(-1)`` or ``Replicate()``.
        fp8_all_gather: a sequence-sharded input goes over the wire in the layer's FP8
            input format (False: in its own dtype).
        wire_stats: counts the bytes this rank sends (``WireStats``), by collective.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        fp8_all_gather: bool = True,
        wire_stats: WireStats | None = None,
    ) -> None:
        super().__init__()
        self.input_layout = _checked_layout("input_layouts", input_layouts or Replicate(), last_dim=False)
        self.output_layout = _checked_layout("output_layouts", output_layouts or Shard(-1), last_dim=True)
        self.fp8_all_gather = fp8_all_gather
        self.wire_stats = wire_stats

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        comm = _comm(device_mesh, self.wire_stats)
        _shard_linear(module, 0, comm, self.src_data_rank)
        gather_dim = None if isinstance(self.input_layout, Replicate) else self.input_layout.dim

        def prepare_input(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if gather_dim is None:
                x = CopyToGroup.apply(x, comm)
            else:  # the layer's cast as it is now (the controller may move it to finer scales)
                if gather_dim % x.dim() == x.dim() - 1:
                    raise ValueError(f"input_layouts=Shard({gather_dim}) shards the features; use Shard(1), the sequence")
                rule = _wire_rule(layer) if self.fp8_all_gather else None
                tensorwise = rule is not None and rule.tile((1, x.shape[-1])) is None
                x = GatherSequence.apply(x, gather_dim, comm, rule, tensorwise)
            return (x, *args[1:])

        def prepare_output(layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            if isinstance(self.output_layout, Replicate):
                return GatherDim.apply(output, -1, comm)
            return output

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        return module

    def __repr__(self) -> str:
        return (f"Fp8ColwiseParallel(input_layouts={self.input_layout}, output_layouts={self.output_layout}, "
                f"fp8_all_gather={self.fp8_all_gather})")


class Fp8RowwiseParallel(ParallelStyle):
    """Shard a linear layer row-wise (its ``in_features``) over a 1-D device mesh.

    The layer's input is sharded on its last dim (``Shard(-1)``, the default: a
    column-parallel layer's output) or replicated (``Replicate()``: each rank takes its
    slice). Each rank's GEMM gives a partial output that is summed over the ranks in high
    precision: all-reduced (``Replicate()``, the default) or reduce-scattered along the
    sequence (``Shard(1)``, sequence parallel). The bias stays whole on every rank and is
    added once, after the sum (its gradient is summed over the ranks where the output is
    sequence-sharded).

    Args:
        input_layouts: ``Shard(-1)`` or ``Replicate()``.
        output_layouts: ``Replicate()`` or ``Shard(d)`` for a dim ``d`` other than the last.
        wire_stats: counts the bytes this rank sends (``WireStats``), by collective.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        wire_stats: WireStats | None = None,
    ) -> None:
        super().__init__()
        self.input_layout = _checked_layout("input_layouts", input_layouts or Shard(-1), last_dim=True)
        self.output_layout = _checked_layout("output_layouts", output_layouts or Replicate(), last_dim=False)
        self.wire_stats = wire_stats

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        comm = _comm(device_mesh, self.wire_stats)
        _shard_linear(module, 1, comm, self.src_data_rank)
        scatter_dim = None if isinstance(self.output_layout, Replicate) else self.output_layout.dim
        held_bias: list[nn.Parameter | None] = []

        def prepare_input(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            # The layer must not add the bias to its partial output: it is added once, after the sum.
            held_bias.append(layer.bias)
            layer.bias = None
            x = args[0]
            if isinstance(self.input_layout, Replicate):
                x = ChunkDim.apply(x, -1, comm)
            return (x, *args[1:])

        def prepare_output(layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor | None) -> Any:
            bias = held_bias.pop() if held_bias else None
            layer.bias = bias
            if output is None:  # the forward raised: the bias is back, the error goes on
                return None
            if scatter_dim is None:
                output = ReduceFromGroup.apply(output, comm)
            else:
                _check_divisible("the sequence", output.shape[scatter_dim], comm.world)
                output = ReduceScatterDim.apply(output, scatter_dim, comm)
                bias = None if bias is None else CopyToGroup.apply(bias, comm)
            return output if bias is None else output + bias.to(output.dtype)

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"Fp8RowwiseParallel(input_layouts={self.input_layout}, output_layouts={self.output_layout})"


def _comm(device_mesh: DeviceMesh, stats: WireStats | None) -> GroupComm:
    if device_mesh.ndim != 1:
        raise ValueError(
            f"amp8's tensor-parallel styles take a 1-D device mesh, got {device_mesh.ndim} dims; "
            'pass the tensor-parallel dim, e.g. mesh["tp"]'
        )
    return GroupComm.over(device_mesh.get_group(), stats)


def _checked_layout(name: str, layout: Placement, *, last_dim: bool) -> Placement:
    """``layout`` where it is ``Replicate()`` or a ``Shard`` of the last dim (``last_dim``)
    or of another dim (not ``last_dim``); else a ValueError naming what is accepted."""
    if isinstance(layout, Replicate):
        return layout
    if isinstance(layout, Shard) and (layout.dim == -1) == last_dim:
        return layout
    wanted = "Shard(-1)" if last_dim else "Shard(1) (the sequence dim)"
    raise ValueError(f"{name}={layout!r} is not supported here; use Replicate() or {wanted}")


def _check_divisible(what: str, size: int, world: int) -> None:
    if size % world:
        raise ValueError(f"{what} ({size}) does not split evenly over {world} tensor-parallel ranks")


def _shard_linear(module: nn.Module, dim: int, comm: GroupComm, src_data_rank: int | None) -> None:
    """Keep this rank's slice of ``module``'s weight along ``dim`` (0: rows, with the
    bias; 1: columns), after copying the group's rank ``src_data_rank`` weight to every
    rank (None: each keeps its own)."""
    amp8_layer = isinstance(module, Fp8Linear)
    if not amp8_layer and not isinstance(module, nn.Linear):
        raise TypeError(
            f"amp8's tensor-parallel styles shard amp8.nn.Fp8Linear and nn.Linear layers, got "
            f"{type(module).__name__}; use torch's stock styles for other modules"
        )
    if amp8_layer:
        _check_amp8_layer(module)  # type: ignore[arg-type]
    size, world = module.weight.shape[dim], comm.world
    kind = "out_features" if dim == 0 else "in_features"
    _check_divisible(f"{type(module).__name__}.{kind}", size, world)
    local = size // world
    if amp8_layer and local % GEMM_ALIGNMENT:
        raise ValueError(
            f"{kind}={size} over {world} ranks gives shards of {local}, not a multiple of {GEMM_ALIGNMENT} "
            f"as FP8 GEMMs need; pick a tensor-parallel size that leaves multiples of {GEMM_ALIGNMENT}, "
            "or keep this layer out of the plan"
        )
    if src_data_rank is not None:
        source = dist.get_global_rank(comm.group, src_data_rank)
        tensors = [module.stored_weight.data, module.weight_scale] if amp8_layer else [module.weight.data]
        tensors += [module.bias.data] if module.bias is not None else []
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=source, group=comm.group)
        if amp8_layer:
            module.drop_weight_cache()
    # New Parameters of the local shapes (autograd keeps a Parameter's shape).
    start = comm.rank * local
    if amp8_layer:
        module.narrow_weight(dim, start, local)  # type: ignore[operator]
    else:
        module.weight = _narrowed(module.weight, dim, start, local)
    if dim == 0 and module.bias is not None:
        module.bias = _narrowed(module.bias, 0, start, local)
    setattr(module, kind, local)


def _narrowed(param: nn.Parameter, dim: int, start: int, length: int) -> nn.Parameter:
    return nn.Parameter(param.detach().narrow(dim, start, length).clone(), requires_grad=param.requires_grad)


def _check_amp8_layer(layer: Fp8Linear) -> None:
    """Refuse what tensor parallelism cannot shard: FP8 weights (O3), weights FSDP2 shards."""
    if layer.stored_weight.sharded:
        raise ValueError("this Fp8Linear's weight is sharded by FSDP2 already; tensor parallelism takes O1 or O2")
    if layer.weight_storage is Precision.FP8:
        raise ValueError(
            "amp8's tensor parallelism supports O1 and O2 (FP16 weights); this layer stores FP8 "
            "weights (O3). Use opt_level='O2' with tensor parallelism"
        )


def _wire_rule(module: nn.Module) -> CastRule | None:
    """The layer's input ``CastRule`` where its FP8 format can go on the wire (an
    ``Fp8Linear`` whose input cast is not microscaled), else None."""
    if not isinstance(module, Fp8Linear):
        return None
    rule = module.quantizers.input.rule
    return None if rule.microscaled else rule
