"""``LowBitAdam``'s update groups: parameters whose updates run as one call over flat
buffers (``amp8.optim.group_step``); ``amp8.optim.plan`` sorts the parameters into them.

A group holds the parameters of one param group, device, ``UpdateSpec``, row width and
step count. Their moments (and O3's master weights) live in the group's buffers: each
parameter's state holds views into them, so checkpoints, ``optimizer.state`` and the
reference step see ordinary tensors. So does an FP8 layer's stored weight (the
``ScaledWeight``'s data is a view into the group's weight buffer, its layer's scale
buffer a view into the group's scales), and its FP8 gradient: the layer's backward writes
it into the group's gradient buffer (``amp8.tensor.weight_grad.GradSlot``). A step runs
one update over the buffers: a fixed number of tensor operations per group, whatever the
number of parameters, and a few passes over lists of Python work per parameter.

Anything that replaces a view (``load_state_dict``, a model moved with ``.to()``, a
layer's scales re-stored at another shape, a parameter that has no gradient this step)
is found by the next step, which builds the groups again from the tensors in place. A
gradient of its own (a layer called twice, a gradient set by hand) and the float gradients
and weights of a plain group are copied in, into memory held during a step only; but a
large plain tensor (``amp8.optim.plan.IN_PLACE_ELEMENTS``) is a group of its own whose
step reads its gradient and writes its weight where they are.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch
from torch import nn

from amp8.optim import state as state_storage
from amp8.optim.arithmetic import StepScalars, hyper, step_scalars
from amp8.optim.group_step import GroupSteps, GroupTensors, measure_amaxes
from amp8.optim.spec import StepInputs, UpdateSpec, WeightKind
from amp8.optim.state import MASTER, MOMENTS
from amp8.quant.codec import Layout
from amp8.tensor.stored import StoredWeight
from amp8.tensor.weight_grad import GradSlot

_DTYPE = operator.attrgetter("dtype")

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
    spec: UpdateSpec
    width: int
    device: torch.device
    step: float
    own: int | None = None  # a group of one plain tensor updated in place: its position


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
        self.members: list[Member] = []
        row_tensor: list[int] = []
        row_offset: list[int] = []
        first = 0
        for index, (param, handle, param_state, position) in enumerate(entries):
            rows = -(-state_shape(param_state, param).numel() // width)
            grad_scales = rows if spec.grad.per_row else 1
            self.members.append(
                Member(param, handle, param_state, first, rows, grad_scales=grad_scales, position=position)
            )
            row_tensor += [index] * rows
            row_offset += range(0, rows * width, width)
            first += rows
        total, count = first, len(entries)

        def scales(layout: Layout) -> torch.Tensor | None:
            if not layout.scaled:
                return None
            return torch.ones(total if layout.per_row else count, device=device)

        def stored(layout: Layout, on: torch.device | str = device) -> torch.Tensor:
            return torch.zeros((total, width), dtype=layout.dtype or torch.float32, device=on)

        # The gradient and weight copies: none (meta) where the step reads the tensor where it is.
        copies_on = "meta" if key.own is not None else device

        master = spec.weight is WeightKind.MASTER
        self.tensors = GroupTensors(
            grad=stored(spec.grad, copies_on), grad_scale=scales(spec.grad),
            exp_avg=stored(spec.exp_avg), exp_avg_scale=scales(spec.exp_avg),
            exp_avg_sq=stored(spec.exp_avg_sq), exp_avg_sq_scale=scales(spec.exp_avg_sq),
            weight=stored(spec.weight_layout, copies_on), weight_scale=scales(spec.weight_layout),
            amaxes=torch.zeros((3, count), device=device),
            row_amaxes=torch.zeros((3, total), device=device),
            fp8_weight=stored(spec.fp8_weight) if master else None,
            fp8_weight_scale=scales(spec.fp8_weight) if master else None,
            row_tensor=torch.tensor(row_tensor, dtype=torch.int64, device=device),
            row_offset=torch.tensor(row_offset, dtype=torch.int32, device=device),
            draw=torch.tensor(draws, dtype=torch.int64, device=device),
            steps=torch.stack([member.state["step"].to(device) for member in self.members]),
        )
        # The step counts, one vector for the group (what a step advances in one
        # operation); each state holds its count as a 0-d view, as torch stores it.
        for index, member in enumerate(self.members):
            self._pack(index, member)
            member.state["step"] = member.views["step"] = self.tensors.steps[index]
        self._grad_views = [self._view(self.tensors.grad, member, member.param) for member in self.members]
        grad_scales = self.tensors.grad_scale  # shaped as a gradient's: (rows, 1) per row, () per tensor
        self._grad_scale_views = [
            None if grad_scales is None else self._scale_view(grad_scales, spec.grad, index, member, (member.rows, 1))
            for index, member in enumerate(self.members)
        ]
        # FP8 gradients land in the buffer (``GradSlot``): the backward writes each where
        # the step reads it. ``round`` advances at each step, so a slot is taken once between steps.
        self._round = [0]
        slots = spec.grad.scaled and spec.weight is not WeightKind.PLAIN
        if slots:
            for member, data, scale in zip(self.members, self._grad_views, self._grad_scale_views):
                member.handle.grad_slot = GradSlot(member.param, data, scale, self._round)  # type: ignore[union-attr]
        self._weight_views = [self._view(self.tensors.weight, member, member.param) for member in self.members]
        # Each stored weight's scales, where the step writes them: the layers' scale
        # buffers are views into the group's scale vector, as their weights are into its
        # weight buffer.
        self._scale_pieces: list[torch.Tensor] = []
        if spec.weight is WeightKind.FP16_SCALED:
            self._scale_pieces = list(self.tensors.weight_scale.unbind())  # type: ignore[union-attr]
        elif master:
            fp8_scales = self.tensors.fp8_weight_scale
            assert fp8_scales is not None
            self._scale_pieces = [
                self._scale_view(fp8_scales, spec.fp8_weight, index, member, member.handle.stored_scale.shape)  # type: ignore[union-attr]
                for index, member in enumerate(self.members)
            ]
        for member, piece in zip(self.members, self._scale_pieces):
            member.handle.place_scale(piece)  # type: ignore[union-attr]
        self._index()
        # Buffers that hold copies for one step only (a plain group's gradients and
        # weights): their memory is there from ``gather`` to ``end_step``, not between
        # steps, so the group keeps no second copy of what the model holds. FP8 gradients
        # live in their buffer from the backward that writes them on.
        self._step_buffers = [] if slots or key.own is not None else [self.tensors.grad]
        if spec.weight is WeightKind.PLAIN and key.own is None:
            self._step_buffers.append(self.tensors.weight)
        # Bytes of each step buffer: the memory a step holds beyond the model's and the state's.
        self.step_bytes = [buffer.untyped_storage().nbytes() for buffer in self._step_buffers]
        # Between steps ``tensors`` shows the step buffers as meta tensors of their shapes:
        # a tensor whose memory was given back must not be read (torch does not check).
        self._held = self.tensors
        self._idle = self.tensors._replace(**{
            name: torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
            for name, buffer in self.tensors._asdict().items()
            if any(buffer is step_buffer for step_buffer in self._step_buffers)
        })
        # Where a tensor's last row has padding, fresh memory is zeroed: the padding of every
        # buffer stays zero.
        self._padded = sum(member.rows for member in self.members) * width != sum(self._numels)
        self.measure_amaxes()
        self.end_step()

    # -- layout ------------------------------------------------------------------------
    def _view(self, buffer: torch.Tensor, member: Member, like: torch.Tensor) -> torch.Tensor:
        """``member``'s tensor in ``buffer``, shaped like ``like`` (what it replaces)."""
        start = member.first_row * self.key.width
        return buffer.view(-1)[start:start + like.numel()].view(like.shape)

    def _scale_view(
        self, scales: torch.Tensor, layout: Layout, index: int, member: Member, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``member``'s scales in a group scale vector: its rows' (shaped ``shape``, as its
        own) where ``layout`` scales per row, else its one."""
        if layout.per_row:
            return scales[member.first_row:member.first_row + member.rows].view(shape)
        return scales[index]

    def _pack(self, index: int, member: Member) -> None:
        """Copy ``member``'s state and stored weight into the buffers and leave views in their place."""
        spec, tensors = self.key.spec, self.tensors
        for key, data, scales, layout in (
            (MOMENTS[0], tensors.exp_avg, tensors.exp_avg_scale, spec.exp_avg),
            (MOMENTS[1], tensors.exp_avg_sq, tensors.exp_avg_sq_scale, spec.exp_avg_sq),
        ):
            self._adopt(member, key, data)
            if scales is not None:
                self._adopt_scale(member, key + state_storage.SCALE_SUFFIX, scales, layout, index)
        if spec.weight is WeightKind.PLAIN:
            return
        handle = member.handle
        assert handle is not None  # FP16_SCALED and MASTER weights are FP8 layers'
        if spec.weight is WeightKind.MASTER:
            assert tensors.weight_scale is not None and tensors.fp8_weight is not None
            self._adopt(member, MASTER, tensors.weight)
            master_scale = MASTER + state_storage.SCALE_SUFFIX
            self._adopt_scale(member, master_scale, tensors.weight_scale, spec.weight_layout, index)
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

    def _adopt_scale(self, member: Member, key: str, scales: torch.Tensor, layout: Layout, index: int) -> None:
        """Move the scales ``state[key]`` into the group's ``scales`` and put the view in the state."""
        current = member.state[key]
        view = self._scale_view(scales, layout, index, member, current.shape)
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
        for handle in self._handles:
            handle.grad_slot = GradSlot.empty()  # (a gradient in the old slot keeps the old buffer alive)

    # -- the amaxes the scales are bounded from -------------------------------------------
    def measure_amaxes(self) -> None:
        """``group_step.measure_amaxes`` of the buffers (a step keeps the amaxes current;
        this is for a new group, and after a write from outside the optimizer)."""
        measure_amaxes(self.key.spec, self.tensors)
        self._versions = self._buffer_versions()

    def _buffer_versions(self) -> list[int]:
        # An unscaled (plain float32) weight's amax bounds nothing, so a write to it needs no measure.
        stored = (self.tensors.exp_avg, self.tensors.exp_avg_sq, self.tensors.weight)
        return [t._version for t in stored[:3 if self.key.spec.weight_layout.scaled else 2]]

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
        for buffer, nbytes in zip(self._step_buffers, self.step_bytes):
            storage = buffer.untyped_storage()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
                if self._padded:
                    buffer.zero_()

    def end_step(self) -> None:
        """Free the step buffers' memory until the next ``gather`` (their views stay)."""
        for buffer in self._step_buffers:
            buffer.untyped_storage().resize_(0)
        self.tensors = self._idle

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
        # Gradients in their slots have the slots' sizes and dtypes: only others are checked.
        in_slots = all(map(operator.is_, datas, self._grad_views)) and all(
            map(operator.is_, grad_scales, self._grad_scale_views))
        spec = self.key.spec
        if not in_slots:  # (a shape is the param's, or copy_ fails)
            if list(map(torch.Tensor.numel, datas)) != self._numels:
                return False
            if not spec.grad.scaled:
                if not all(map(torch.Tensor.is_floating_point, datas)):
                    return False
            elif set(map(_DTYPE, datas)) != {spec.grad.dtype} or any(map(operator.is_, grad_scales, repeat(None))) \
                    or set(map(_DTYPE, grad_scales)) != {torch.float32} \
                    or list(map(torch.Tensor.numel, grad_scales)) != self._grad_scale_counts:
                return False
        held = self._held
        if self.key.own is not None:  # one plain tensor, read and written where it is
            param = self._params[0]
            if not param.is_contiguous() or param.dtype is not torch.float32:
                return False
            rows = held.weight.shape
            held = held._replace(grad=datas[0].reshape(rows).float(), weight=param.detach().view(rows))
        self.tensors = held
        if self._buffer_versions() != self._versions:  # written from outside the optimizer
            self.measure_amaxes()
        self._hold_step_buffers()
        self._round[0] += 1  # the next backward may take the slots again
        if self.key.own is not None:
            return True
        if not in_slots:
            self._copy_grads_in(datas, grad_scales)
        if spec.weight is WeightKind.PLAIN:
            torch._foreach_copy_(self._weight_views, self._params)
        return True

    def _copy_grads_in(self, datas: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor | None, ...]) -> None:
        """Copy into the gradient buffer the gradients that are not already there: float
        gradients, and FP8 ones in memory of their own (a layer called twice, a gradient
        set by hand), with their scales."""
        moved = [(view, data, scale_view, scale) for view, data, scale_view, scale
                 in zip(self._grad_views, datas, self._grad_scale_views, scales)
                 if data is not view or scale is not scale_view]
        views, sources, scale_views, scale_sources = map(list, zip(*moved))
        torch._foreach_copy_(views, sources)
        if scale_sources[0] is not None:  # FP8 gradients: all of them have scales
            torch._foreach_copy_(scale_views, scale_sources)

    def run(self, steps: GroupSteps, group: dict[str, Any], seed_part: int, first_draw: int,
            skip: torch.Tensor, coefficients: dict[Any, StepScalars]) -> None:
        """The update of every member (after ``gather``), unless ``skip``; then the plain
        weights copied back to their Parameters (the stored weights and their scales are the
        buffers' views) and the layers told to drop their casts. ``coefficients`` holds this
        step's for the groups run before: the groups of one plan that were built at one
        step count and param group have advanced together since, and share them."""
        shared = (self.key.param_group, self.key.step, self.key.device)
        s = coefficients.get(shared)
        if s is None:
            s = coefficients[shared] = step_scalars(hyper(group, as_tensors=False), self.tensors.steps[0] + 1)
        draws: tuple[Any, Any] = (seed_part, first_draw)
        if steps.compile:  # (tensors: one graph serves every step)
            draws = tuple(torch.tensor(value, dtype=torch.int64) for value in draws)
        steps(self.key.spec, self.tensors, hyper(group, as_tensors=steps.compile), s, *draws, skip)
        self._versions = self._buffer_versions()
        if self.key.spec.weight is WeightKind.PLAIN:
            if self.key.own is None:
                torch._foreach_copy_(self._params, self._weight_views)
            return
        for drop_cache in self._drop_caches:  # the layers' casts of the old weights
            drop_cache()


def state_shape(param_state: dict[str, Any], param: nn.Parameter) -> torch.Size:
    """The shape of ``param``'s state tensors (its master weight's where it has one)."""
    return param_state.get(MASTER, param).shape


