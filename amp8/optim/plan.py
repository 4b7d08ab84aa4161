"""Which path each of ``LowBitAdam``'s parameters takes in a step: an update group
(``amp8.optim.update_groups``, one pass over flat buffers), its own reference update
(``amp8.optim.reference_step``), or torch's fused step (``amp8.optim.plain_step``); and
what a step reads from each parameter to decide (``StepInputs``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from amp8.optim import state as state_storage
from amp8.optim.group_step import MAX_ELEMENTS
from amp8.optim.plain_step import takes_plain_step
from amp8.optim.spec import GradParts, StepInputs, StepKind, UpdateSpec, WeightKind, stored_grad, update_spec
from amp8.optim.state import MOMENTS
from amp8.optim.update_groups import GroupKey, UpdateGroup, state_shape
from amp8.quant import scaling
from amp8.quant.codec import Tiling
from amp8.tensor.scaled import is_sharded
from amp8.tensor.stored import StoredWeight

TENSOR_ROW_WIDTH = 256
"""Elements per buffer row where every scale is per tensor (for tensors of at least that
many elements; smaller ones take the power of two that holds them): what a tensor's last
row may leave unused (zero padding)."""


IN_PLACE_ELEMENTS = 1 << 22
"""The fewest elements of a plain float32 parameter (a tied embedding table, a layer kept
in high precision) whose update reads its gradient and writes its weight where they are,
in a group of its own, rather than through copies in a shared group's buffers. The copies
move 24 bytes an element (at this size about 0.1 ms of an H100's bandwidth, and 34 MB held
through the step); a group of its own costs one more call, host time that the step of a
model with many tensors this large (a large model) hides, its host running ahead of the GPU."""


def updates_in_place(spec: UpdateSpec, param: nn.Parameter, width: int) -> bool:
    """Whether ``param``'s update runs in a group of its own over its own memory
    (``IN_PLACE_ELEMENTS``): a large, contiguous float32 plain weight that fills whole rows."""
    return (spec.weight is WeightKind.PLAIN and param.dtype is torch.float32
            and param.numel() >= IN_PLACE_ELEMENTS and param.numel() % width == 0 and param.is_contiguous())


def row_width(spec: UpdateSpec, shape: torch.Size) -> int | None:
    """The buffer row width of a tensor of ``shape`` under ``spec``: its columns where a
    storage scales per row of a matrix, the block size where one scales per flat block,
    else ``TENSOR_ROW_WIDTH`` (or the power of two that holds a smaller tensor); None where
    no width serves every storage (tiles, scales not in float32, blocks of two sizes, rows
    beside blocks)."""
    layouts = [spec.grad, spec.exp_avg, spec.exp_avg_sq]
    if spec.weight is WeightKind.MASTER:
        layouts.append(spec.fp8_weight)
    if any(layout.tiling is Tiling.TILES or layout.scale_dtype != torch.float32 for layout in layouts):
        return None
    blocks = {layout.block for layout in layouts if layout.tiling is Tiling.BLOCKS}
    if any(layout.tiling is Tiling.ROWS for layout in layouts):
        return shape[1] if len(shape) == 2 and not blocks else None
    if len(blocks) > 1:
        return None
    if blocks:
        return blocks.pop()
    # A small tensor (a bias, a norm's scale) takes rows of the power of two that holds it,
    # so a group of them is not mostly padding.
    return min(TENSOR_ROW_WIDTH, 1 << max(0, shape.numel() - 1).bit_length())


def groupable(spec: UpdateSpec, param: nn.Parameter, handle: StoredWeight | None,
              param_state: dict[str, Any]) -> int | None:
    """The row width ``param``'s update takes in a group, or None where it takes its
    own update: a layout no width serves, an empty or huge tensor, a ``DTensor`` (FSDP2's
    shards), weight scales not already of the shape the step writes."""
    shape = state_shape(param_state, param)
    if shape.numel() == 0 or shape.numel() > MAX_ELEMENTS or shape != param.shape:
        return None
    if is_sharded(param) or (handle is None and is_sharded(param.grad)):  # DTensors keep their own update
        return None
    width = row_width(spec, shape)
    if width is None:
        return None
    if spec.weight is WeightKind.FP16_SCALED:
        if handle is None or handle.layout.dtype != torch.float16 or handle.stored_scale.shape != () \
                or handle.stored_scale.dtype != torch.float32:
            return None
    if spec.weight is WeightKind.MASTER:
        if handle is None or param.dim() != 2 or not spec.fp8_previous_scale \
                or handle.stored_scale.dtype != torch.float32:
            return None
    return width


class Candidate(NamedTuple):
    """A parameter whose update may run in a group, with what sorting it needs."""

    group_index: int  # its param group's index
    param: nn.Parameter
    handle: StoredWeight | None
    state: dict[str, Any]
    group: dict[str, Any]  # its param group
    draw: int  # its noise draw, counted from the step's first
    grad: GradParts  # this step's stored gradient
    position: int  # its place among the optimizer's parameters


class OwnUpdate(NamedTuple):
    """A parameter that takes its own reference update."""

    group_index: int
    param: nn.Parameter
    position: int


def build_groups(candidates: list[Candidate]) -> tuple[list[UpdateGroup], list[OwnUpdate]]:
    """Sort ``candidates`` into update groups; those that take their own update."""
    grouped: dict[GroupKey, tuple[list[Any], list[int]]] = {}
    alone = []
    for c in candidates:
        spec = update_spec(c.param, c.handle, c.state, c.group, c.grad)
        width = groupable(spec, c.param, c.handle, c.state)
        if width is None:
            alone.append(OwnUpdate(c.group_index, c.param, c.position))
            continue
        own = c.position if updates_in_place(spec, c.param, width) else None
        key = GroupKey(c.group_index, spec, width, c.param.device, float(c.state["step"]), own)
        entries, draws = grouped.setdefault(key, ([], []))
        entries.append((c.param, c.handle, c.state, c.position))
        draws.append(c.draw)
    return [UpdateGroup(key, entries, draws) for key, (entries, draws) in grouped.items()], alone


@dataclass
class UpdatePlan:
    """Which path each parameter's update takes, valid while the parameters and their
    kinds are those it was built for and the groups hold their members' tensors."""

    params: list[nn.Parameter]
    kinds: list[StepKind]
    groups: list[UpdateGroup]
    alone: list[OwnUpdate]  # their own reference update
    plain: dict[tuple[int, torch.device], list[nn.Parameter]]  # torch's fused Adam (amp8.optim.plain_step)
    draws: dict[nn.Parameter, int]  # each update's noise draw, counted from the step's first
    total_draws: int
    other_grads: list[GradParts | None] = field(default_factory=list)  # this step's, of ``alone`` (None: sharded)
    sharded_grads: list[torch.Tensor] = field(default_factory=list)  # the averaged chunks of sharded weights
    plain_grads: list[torch.Tensor] = field(default_factory=list)  # of ``plain``

    def fits(self, inputs: StepInputs) -> bool:
        """Whether this plan was built for ``inputs``' parameters and kinds."""
        return (self.kinds == inputs.kinds and len(self.params) == len(inputs.params)
                and all(map(operator.is_, self.params, inputs.params)))

    def nonfinite(self) -> torch.Tensor:
        """A bool on the device: whether any of this step's gradients holds an inf or NaN.
        An FP8 weight gradient says so in its scales (NaN where its cast saw one,
        ``amp8.tensor.weight_grad.GradLayout``): their few floats are read, not the data."""
        tensors = list(self.sharded_grads) + list(self.plain_grads)
        for group in self.groups:
            scale = group.tensors.grad_scale
            tensors.append(group.tensors.grad if scale is None else scale)
        for grad in self.other_grads:
            if grad is not None:
                tensors.append(grad[0] if grad[1] is None else grad[1])
        return ~scaling.all_finite(tensors)

    def gather(self, inputs: StepInputs) -> bool:
        """Every group's ``gather`` of this step's ``inputs``; False where one no longer fits."""
        return all(group.gather(inputs) for group in self.groups)

    def end_step(self) -> None:
        """Free every group's step buffers (see ``UpdateGroup.end_step``)."""
        for group in self.groups:
            group.end_step()

    def release(self) -> None:
        """Give the members of every group their own memory back (see ``UpdateGroup.release``)."""
        for group in self.groups:
            group.release()


def step_inputs(optimizer: Any) -> StepInputs:
    """What each parameter of ``optimizer`` (a ``LowBitAdam``) updates with this step, with
    the stored gradient and state of each ``UPDATE`` one (``StepInputs``). A parameter
    trainable since the optimizer was built gets its state here."""
    inputs = StepInputs([], [], [], [])
    params, kinds, grads, states_now = inputs.params, inputs.kinds, inputs.grads, inputs.states
    states, weights, shard_optimizer = optimizer.state, optimizer.weights, optimizer.level.shard_optimizer
    listed = [param for group in optimizer.param_groups for param in group["params"]]
    # Only a parameter listed twice needs a set of those seen (ids: hashing a tensor is Python).
    seen: set[int] | None = set() if len(set(map(id, listed))) != len(listed) else None
    for param in listed:
        param_state = states.get(param)
        grad = None
        if seen is not None and id(param) in seen:
            kind = StepKind.SKIP  # listed again: updated once, where it is listed first
        elif not param_state and not param.requires_grad:
            kind = StepKind.SKIP  # frozen: no state, no update
        else:
            if not param_state:
                # Frozen when this optimizer was built, trainable since: its state
                # starts now (at O3 its master from the FP8 weight).
                param_state = states[param]
                optimizer.stored.init(param, param_state, None)
            handle = weights.get(param)
            if handle is not None and handle.sharded and shard_optimizer:
                kind = StepKind.SHARDED if optimizer.gradient(param) is not None else StepKind.SKIP
            elif handle is None and takes_plain_step(param, param_state):
                kind = StepKind.PLAIN
            else:
                grad = stored_grad(param, handle)
                kind = StepKind.SKIP if grad is None else StepKind.UPDATE
        if seen is not None:
            seen.add(id(param))
        params.append(param)
        kinds.append(kind)
        grads.append(grad)
        states_now.append(param_state if grad is not None else None)
    return inputs


def build_plan(optimizer: Any, inputs: StepInputs) -> UpdatePlan:
    """Sort ``optimizer``'s parameters by their kinds in ``inputs`` into update groups, the
    plain step and their own updates, and number their noise draws in the reference
    step's order."""
    params = [(index, param) for index, group in enumerate(optimizer.param_groups) for param in group["params"]]
    draws_stochastically = state_storage.rounds_stochastically(MOMENTS[0], optimizer.level.exp_avg)
    draws: dict[nn.Parameter, int] = {}
    plain: dict[tuple[int, torch.device], list[nn.Parameter]] = {}
    candidates, alone = [], []
    for position, ((index, param), kind) in enumerate(zip(params, inputs.kinds)):
        if kind is StepKind.PLAIN:
            plain.setdefault((index, param.device), []).append(param)
            continue
        if kind is StepKind.SKIP:
            continue
        if param in optimizer.weights or draws_stochastically:
            draws[param] = len(draws)
        grad = inputs.grads[position]
        if kind is StepKind.UPDATE and optimizer.grouped and grad is not None:
            candidates.append(Candidate(
                index, param, optimizer.weights.get(param), optimizer.state[param], optimizer.param_groups[index],
                draws.get(param, 0), grad, position,
            ))
        else:
            alone.append(OwnUpdate(index, param, position))
    groups, ungrouped = build_groups(candidates)
    alone = sorted(alone + ungrouped, key=lambda entry: entry.position)
    return UpdatePlan(inputs.params, inputs.kinds, groups, alone, plain, draws, len(draws))
