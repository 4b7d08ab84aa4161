"""``LowBitAdam``'s update groups: parameters whose updates run as one call over flat
buffers (``amp8.optim.group_step``), and the plan that says which parameter takes which
path in a step.

A group holds the parameters of one param group, device, ``UpdateSpec``, row width and
step count. Their moments (and O3's master weights) live in the group's buffers: each
parameter's state holds views into them, so checkpoints, ``optimizer.state`` and the
reference step see ordinary tensors. So does an FP8 layer's stored weight (the
``ScaledWeight``'s data is a view into the group's weight buffer, its layer's scale
buffer a view into the group's scales). Each step copies the gradients in (one copy over
all of them) and runs one update over the buffers; the work per step is a fixed number of
tensor operations per group, whatever the number of parameters, and the Python work per
parameter is a few passes over lists.

Anything that replaces a view (``load_state_dict``, a model moved with ``.to()``, a
layer's scales re-stored at another shape, a parameter that has no gradient this step)
is found by the next step, which builds the groups again from the tensors in place.
The copy of the gradients (and of a plain group's weights) holds memory during a step
only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Callable

import torch
from torch import nn

from amp8.optim import fused
from amp8.optim import state as state_storage
from amp8.optim.fused_update import update_inputs
from amp8.optim.group_step import MAX_ELEMENTS, GroupTensors, adam_group_step, scales_per_row
from amp8.optim.state import MASTER, MOMENTS
from amp8.tensor.scaled import is_sharded
from amp8.tensor.stored import StoredWeight

TENSOR_ROW_WIDTH = 256
"""Elements per buffer row where every scale is per tensor (for tensors of at least that
many elements; smaller ones take the power of two that holds them): what a tensor's last
row may leave unused (zero padding)."""

_DTYPE = operator.attrgetter("dtype")

GroupStep = Callable[[fused.UpdateSpec, GroupTensors, fused.Coefficients, int, Any], None]


def row_width(spec: fused.UpdateSpec, shape: torch.Size) -> int | None:
    """The buffer row width of a tensor of ``shape`` under ``spec``: its columns where a
    storage scales per row of a matrix, the block size where one scales per flat block,
    else ``TENSOR_ROW_WIDTH`` (or the power of two that holds a smaller tensor); None where
    no width serves every storage (tiles, blocks of two sizes, rows beside blocks)."""
    storages = [spec.grad, spec.exp_avg, spec.exp_avg_sq]
    if spec.weight is fused.WeightKind.MASTER:
        storages.append(spec.fp8_weight)
    if any(storage.tile for storage in storages):
        return None
    blocks = {storage.block_size for storage in storages if storage.block_size > 0}
    if any(storage.rows for storage in storages):
        return shape[1] if len(shape) == 2 and not blocks else None
    if len(blocks) > 1:
        return None
    if blocks:
        return blocks.pop()
    # A small tensor (a bias, a norm's scale) takes rows of the power of two that holds it,
    # so a group of them is not mostly padding.
    return min(TENSOR_ROW_WIDTH, 1 << max(0, shape.numel() - 1).bit_length())


@dataclass
class Member:
    """One parameter of a group: where its rows are and the views its state holds."""

    param: nn.Parameter
    handle: StoredWeight | None
    state: dict[str, Any]
    first_row: int
    rows: int
    views: dict[str, torch.Tensor] = field(default_factory=dict)  # state key -> view
    weight_view: torch.Tensor | None = None  # the stored weight's view (FP16, or O3's FP8)
    grad_scales: int = 1  # how many scales its gradient has (1, or one per row)
    position: int = 0  # its place among the optimizer's parameters


@dataclass(frozen=True)
class GroupKey:
    """What the parameters of one group share."""

    param_group: int
    spec: fused.UpdateSpec
    width: int
    device: torch.device
    step: float


class UpdateGroup:
    """The flat buffers of one group's parameters and its step (see the module docstring)."""

    def __init__(
        self,
        key: GroupKey,
        entries: list[tuple[nn.Parameter, StoredWeight | None, dict[str, Any], int]],
        draws: list[int],
    ) -> None:
        self.key = key
        spec, width, device = key.spec, key.width, key.device
        self.step = key.step
        self.members: list[Member] = []
        row_tensor: list[int] = []
        row_offset: list[int] = []
        first = 0
        for index, (param, handle, param_state, position) in enumerate(entries):
            rows = -(-state_shape(param_state, param).numel() // width)
            grad_scales = rows if scales_per_row(spec.grad) else 1
            self.members.append(
                Member(param, handle, param_state, first, rows, grad_scales=grad_scales, position=position)
            )
            row_tensor += [index] * rows
            row_offset += range(0, rows * width, width)
            first += rows
        total = first

        def buffer(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((total, width), dtype=dtype, device=device)

        def scales(storage: fused.Storage) -> torch.Tensor | None:
            if storage.dtype is None:
                return None
            return torch.ones(total if scales_per_row(storage) else len(entries), device=device)

        def stored(storage: fused.Storage) -> torch.Tensor:
            return buffer(storage.dtype or torch.float32)

        weight_dtype = torch.float32 if spec.weight is fused.WeightKind.PLAIN else torch.float16
        master = spec.weight is fused.WeightKind.MASTER
        self.tensors = GroupTensors(
            grad=stored(spec.grad), grad_scale=scales(spec.grad),
            exp_avg=stored(spec.exp_avg), exp_avg_scale=scales(spec.exp_avg),
            exp_avg_sq=stored(spec.exp_avg_sq), exp_avg_sq_scale=scales(spec.exp_avg_sq),
            weight=buffer(weight_dtype),
            weight_scale=None if spec.weight is fused.WeightKind.PLAIN else torch.ones(len(entries), device=device),
            fp8_weight=stored(spec.fp8_weight) if master else None,
            fp8_weight_scale=scales(spec.fp8_weight) if master else None,
            row_tensor=torch.tensor(row_tensor, dtype=torch.int64, device=device),
            row_offset=torch.tensor(row_offset, dtype=torch.int64, device=device),
            draw=torch.tensor(draws, dtype=torch.int64, device=device),
        )
        # The step counts, one vector for the group (what ``run`` advances in one
        # operation); each state holds its count as a 0-d view, as torch stores it.
        self._steps = torch.stack([member.state["step"] for member in self.members])
        for index, member in enumerate(self.members):
            self._pack(index, member)
            member.state["step"] = member.views["step"] = self._steps[index]
        self._grad_views = [self._view(self.tensors.grad, member, member.param) for member in self.members]
        self._weight_views = [self._view(self.tensors.weight, member, member.param) for member in self.members]
        # Each stored weight's scales, where the step writes them: the layers' scale
        # buffers are views into the group's scale vector, as their weights are into its
        # weight buffer.
        self._scale_pieces: list[torch.Tensor] = []
        if spec.weight is fused.WeightKind.FP16_SCALED:
            self._scale_pieces = list(self.tensors.weight_scale.unbind())  # type: ignore[union-attr]
        elif spec.weight is fused.WeightKind.MASTER:
            fp8_scales = self.tensors.fp8_weight_scale
            assert fp8_scales is not None
            self._scale_pieces = [
                self._scale_view(
                    fp8_scales, spec.fp8_weight, index, member, member.handle.stored_scale  # type: ignore[union-attr]
                )
                for index, member in enumerate(self.members)
            ]
        for member, piece in zip(self.members, self._scale_pieces):
            member.handle.place_scale(piece)  # type: ignore[union-attr]
        self._index()
        # Buffers that hold copies for one step only (the gradients; a plain group's
        # weights): their memory is there from ``gather`` to ``end_step``, not between
        # steps, so the group keeps no second copy of what the model holds.
        self._step_buffers = [self.tensors.grad]
        if spec.weight is fused.WeightKind.PLAIN:
            self._step_buffers.append(self.tensors.weight)
        self._step_bytes = [buffer.untyped_storage().nbytes() for buffer in self._step_buffers]
        # Where a tensor's last row has padding, fresh memory is zeroed: the padding of every
        # buffer stays zero (the per-tensor amaxes read it).
        self._padded = sum(member.rows for member in self.members) * width != sum(self._numels)
        self.end_step()

    # -- layout ------------------------------------------------------------------------
    def _view(self, buffer: torch.Tensor, member: Member, like: torch.Tensor) -> torch.Tensor:
        """``member``'s tensor in ``buffer``, shaped like ``like`` (what it replaces)."""
        start = member.first_row * self.key.width
        return buffer.view(-1)[start:start + like.numel()].view(like.shape)

    def _scale_view(
        self, scales: torch.Tensor, storage: fused.Storage, index: int, member: Member, like: torch.Tensor
    ) -> torch.Tensor:
        """``member``'s scales in a group scale vector, shaped like ``like`` (its own)."""
        if scales_per_row(storage):
            return scales[member.first_row:member.first_row + member.rows].view(like.shape)
        return scales[index]

    def _pack(self, index: int, member: Member) -> None:
        """Copy ``member``'s state and stored weight into the buffers and leave views in their place."""
        spec, tensors = self.key.spec, self.tensors
        for key, data, scales, storage in (
            (MOMENTS[0], tensors.exp_avg, tensors.exp_avg_scale, spec.exp_avg),
            (MOMENTS[1], tensors.exp_avg_sq, tensors.exp_avg_sq_scale, spec.exp_avg_sq),
        ):
            self._adopt(member, key, data)
            if scales is not None:
                self._adopt_scale(member, key + state_storage.SCALE_SUFFIX, scales, storage, index)
        if spec.weight is fused.WeightKind.PLAIN:
            return
        handle = member.handle
        assert handle is not None  # FP16_SCALED and MASTER weights are FP8 layers'
        if spec.weight is fused.WeightKind.MASTER:
            assert tensors.weight_scale is not None and tensors.fp8_weight is not None
            self._adopt(member, MASTER, tensors.weight)
            master_scale = MASTER + state_storage.SCALE_SUFFIX
            self._adopt_scale(member, master_scale, tensors.weight_scale, fused.Storage(torch.float16), index)
            member.weight_view = self._view(tensors.fp8_weight, member, handle.data)
        else:
            member.weight_view = self._view(tensors.weight, member, handle.data)
        handle.place(member.weight_view)

    def _adopt(self, member: Member, key: str, buffer: torch.Tensor) -> None:
        """Move ``state[key]`` into ``buffer`` and put the view in the state."""
        current = member.state[key]
        view = self._view(buffer, member, current)
        view.copy_(current)
        member.state[key] = member.views[key] = view

    def _adopt_scale(self, member: Member, key: str, scales: torch.Tensor, storage: fused.Storage, index: int) -> None:
        """Move the scales ``state[key]`` into the group's ``scales`` and put the view in the state."""
        current = member.state[key]
        view = self._scale_view(scales, storage, index, member, current)
        view.copy_(current)
        member.state[key] = member.views[key] = view

    def release(self) -> None:
        """Give every member's state and stored weight its own memory again (the group
        is being dropped), where they are still this group's views."""
        for member in self.members:
            for key, view in member.views.items():
                if member.state.get(key) is view:
                    member.state[key] = view.clone()
            handle = member.handle
            if handle is not None and member.weight_view is not None and handle.data is member.weight_view:
                handle.place(member.weight_view.clone())
        for handle, (registry, name), piece in zip(self._handles, self._scale_slots, self._scale_pieces):
            if registry.get(name) is piece:
                handle.place_scale(piece.clone())

    # -- a step --------------------------------------------------------------------------
    def _index(self) -> None:
        """Flat lists over the members, so that a step checks and copies what the group
        holds in a few passes over lists rather than Python work per member."""
        members = self.members
        self._positions = [member.position for member in members]
        self._last_position = max(self._positions)
        self._states = [member.state for member in members]
        self._view_owners = [member.state for member in members for _ in member.views]
        self._view_keys = [key for member in members for key in member.views]
        self._view_tensors = [view for member in members for view in member.views.values()]
        self._params = [member.param for member in members]
        self._numels = [member.param.numel() for member in members]
        self._grad_scale_counts = [member.grad_scales for member in members]
        self._placed_weights = [member.weight_view for member in members if member.weight_view is not None]
        self._handles = [member.handle for member in members if member.handle is not None]  # none in a plain group
        self._scale_slots = [handle.scale_slot() for handle in self._handles]
        self._drop_caches = [handle.cache_dropper() for handle in self._handles]

    def _hold_step_buffers(self) -> None:
        """Give the step buffers their memory (zeroed where tensors leave padding)."""
        for buffer, nbytes in zip(self._step_buffers, self._step_bytes):
            storage = buffer.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
                if self._padded:
                    buffer.zero_()

    def end_step(self) -> None:
        """Free the step buffers' memory until the next ``gather`` (their views stay)."""
        for buffer in self._step_buffers:
            buffer.untyped_storage().resize_(0)

    def gather(self, inputs: StepInputs) -> bool:
        """Copy this step's gradients (and plain weights) into the buffers, from
        ``inputs`` (each parameter's stored gradient and state, by its position among the
        optimizer's parameters). False, with nothing changed, where a member's state,
        weight, scales or gradient is no longer what the group was built on."""
        if self._last_position >= len(inputs.kinds):
            return False
        states = list(map(inputs.states.__getitem__, self._positions))
        grads = list(map(inputs.grads.__getitem__, self._positions))
        if any(map(operator.is_, grads, repeat(None))):
            return False
        if not all(map(operator.is_, states, self._states)):
            return False
        if not all(map(operator.is_, map(dict.get, self._view_owners, self._view_keys), self._view_tensors)):
            return False
        # The stored weights: the optimizer's Parameter is the layer's own (amp8 took it over in place).
        if self._placed_weights and not all(
            map(operator.is_, map(getattr, self._params, repeat("_data"), repeat(None)), self._placed_weights)
        ):
            return False
        # The layers' scale buffers are still the group's (a load, ``.to()`` or a change of
        # recipe replaces them).
        if self._scale_slots and not all(
            map(operator.is_, map(dict.get, *zip(*self._scale_slots)), self._scale_pieces)
        ):
            return False
        datas, grad_scales, _ = zip(*grads)
        if list(map(torch.Tensor.numel, datas)) != self._numels:  # (a shape is the param's, or copy_ fails)
            return False
        spec = self.key.spec
        if spec.grad.dtype is None:
            if not all(map(torch.Tensor.is_floating_point, datas)):
                return False
        elif set(map(_DTYPE, datas)) != {spec.grad.dtype} or any(map(operator.is_, grad_scales, repeat(None))) \
                or set(map(_DTYPE, grad_scales)) != {torch.float32} \
                or list(map(torch.Tensor.numel, grad_scales)) != self._grad_scale_counts:
            return False
        self._hold_step_buffers()
        torch._foreach_copy_(self._grad_views, datas)
        tensors = self.tensors
        if tensors.grad_scale is not None:
            if scales_per_row(spec.grad):  # (R, 1) each
                torch.cat(grad_scales, out=tensors.grad_scale.view(-1, 1))
            else:  # 0-d each
                torch.stack(grad_scales, out=tensors.grad_scale)
        if spec.weight is fused.WeightKind.PLAIN:
            torch._foreach_copy_(self._weight_views, self._params)
            return True
        return True

    def run(self, step: GroupStep, group: dict[str, Any], seed_part: int, first_draw: int, as_tensors: bool) -> None:
        """The update of every member (after ``gather``), then the plain weights copied
        back to their Parameters (the stored weights and their scales are the buffers'
        views), the layers told to drop their casts, and the step counts advanced."""
        self.step += 1
        scalars = fused.coefficients(group, self.step, as_tensors=as_tensors)
        if as_tensors:
            step(self.key.spec, self.tensors, scalars, _int64(seed_part), _int64(first_draw))
        else:
            step(self.key.spec, self.tensors, scalars, seed_part, first_draw)
        self._steps.add_(1.0)
        if self.key.spec.weight is fused.WeightKind.PLAIN:
            torch._foreach_copy_(self._params, self._weight_views)
            return
        for drop_cache in self._drop_caches:  # the layers' casts of the old weights
            drop_cache()


def _int64(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def state_shape(param_state: dict[str, Any], param: nn.Parameter) -> torch.Size:
    """The shape of ``param``'s state tensors (its master weight's where it has one)."""
    return param_state.get(MASTER, param).shape


def groupable(
    spec: fused.UpdateSpec, param: nn.Parameter, handle: StoredWeight | None, param_state: dict[str, Any]
) -> int | None:
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
    if spec.weight is fused.WeightKind.FP16_SCALED:
        if handle is None or handle.stored_scale.shape != () or handle.stored_scale.dtype != torch.float32:
            return None
    if spec.weight is fused.WeightKind.MASTER:
        if handle is None or not spec.fp8_previous_scale or handle.stored_scale.dtype != torch.float32:
            return None
    return width


def build_groups(
    candidates: list[tuple[int, nn.Parameter, StoredWeight | None, dict[str, Any], dict[str, Any], int, Any, int]],
) -> tuple[list[UpdateGroup], list[tuple[int, nn.Parameter, int]]]:
    """Sort the parameters that may update in groups, each ``(param group index, param,
    handle, state, param group, draw, stored gradient, position among the optimizer's
    parameters)``, into update groups; the ``(param group index, param, position)`` of
    those that take their own update."""
    grouped: dict[GroupKey, tuple[list[Any], list[int]]] = {}
    alone = []
    for index, param, handle, param_state, group, draw, grad, position in candidates:
        inputs = update_inputs(param, handle, param_state, group, grad)
        width = None if inputs is None else groupable(inputs[0], param, handle, param_state)
        if inputs is None or width is None:
            alone.append((index, param, position))
            continue
        key = GroupKey(index, inputs[0], width, param.device, float(param_state["step"]))
        entries, draws = grouped.setdefault(key, ([], []))
        entries.append((param, handle, param_state, position))
        draws.append(draw)
    return [UpdateGroup(key, entries, draws) for key, (entries, draws) in grouped.items()], alone


@dataclass
class StepInputs:
    """What each parameter's update is this step, in the optimizer's order: its kind
    ("skip", "plain", "sharded" or "update") and, for an "update", its stored gradient
    ``(data, scales, block size)`` and its state (None for the others). Parallel lists,
    so that a step makes no Python object per parameter beyond what it reads."""

    params: list[nn.Parameter]
    kinds: list[str]
    grads: list[tuple[torch.Tensor, torch.Tensor | None, int] | None]
    states: list[dict[str, Any] | None]


@dataclass
class UpdatePlan:
    """Which path each parameter's update takes, valid while the parameters and their
    kinds are those it was built for and the groups hold their members' tensors."""

    params: list[nn.Parameter]
    kinds: list[str]
    groups: list[UpdateGroup]
    alone: list[tuple[int, nn.Parameter, int]]  # (param group index, param, position): their own update
    plain: dict[tuple[int, torch.device], list[nn.Parameter]]  # torch's fused Adam (amp8.optim.plain_step)
    draws: dict[nn.Parameter, int]  # each update's noise draw, counted from the step's first
    total_draws: int
    other_grads: list[torch.Tensor] = field(default_factory=list)  # this step's gradients outside the groups

    def fits(self, inputs: StepInputs) -> bool:
        """Whether this plan was built for ``inputs``' parameters and kinds."""
        return (self.kinds == inputs.kinds and len(self.params) == len(inputs.params)
                and all(map(operator.is_, self.params, inputs.params)))

    def gradients(self) -> list[torch.Tensor]:
        """This step's gradients as stored, for the finiteness check: each group's
        gradient buffer (after ``gather``) and the gradients outside the groups."""
        return [group.tensors.grad for group in self.groups] + self.other_grads

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
