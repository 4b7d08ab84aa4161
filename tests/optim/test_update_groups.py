"""LowBitAdam's update groups (amp8/optim/update_groups.py): the same results as each
tensor's own update, bit for bit eagerly, a number of operations per step that does not
grow with the number of parameters, and groups that notice when what they hold changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import amp8
from amp8.optim import LowBitAdam
from amp8.optim.arithmetic import Decay
from amp8.optim.spec import UpdateSpec, WeightKind
from amp8.quant.codec import Layout, Tiling
from amp8.nn.selection import SpeedRule
from amp8.optim import group_step, plan
from amp8.optim.plan import TENSOR_ROW_WIDTH, row_width
from conftest import assert_bitwise_equal, assert_checkpoint_round_trips, compact_state, cuda_fp8, load_bench

counting = load_bench("counting")

RECIPES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe(granularity="rowwise"),
    "delayed": amp8.Recipe(scaling="delayed"),
}
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-l2-maximize": (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1, maximize=True)),
}


def _model(layers: int = 2, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for index in range(layers):
        blocks += [nn.Linear(width, width + 16 * (index % 2 == 0)), nn.GELU()]
        width += 16 * (index % 2 == 0)
    return nn.Sequential(*blocks, nn.LayerNorm(width))


def _twins(level: str, recipe: amp8.Recipe, optimizer: str, layers: int = 2, device: str = "cpu",
           layer_selection: str | SpeedRule = "all", **options: Any) -> tuple[list[nn.Module], list[LowBitAdam]]:
    """One model and its copy on ``device``: the first stepped tensor by tensor, the second
    in groups."""
    # Every layer in FP8 by default: on CUDA the default speed rule would keep these small ones in float32.
    model, _ = amp8.initialize(_model(layers).to(device), None, level, recipe, layer_selection=layer_selection)
    models = [model, copy.deepcopy(model)]
    optimizer_class, kwargs = OPTIMIZERS[optimizer]
    optimizers = [
        LowBitAdam.from_optimizer(optimizer_class(m.parameters(), **kwargs), amp8.LEVELS[level], grouped=grouped, **options)
        for m, grouped in zip(models, (False, True))
    ]
    return models, optimizers


def _train(models: list[nn.Module], optimizers: list[LowBitAdam], steps: int, start: int = 0) -> None:
    first = next(models[0].parameters())
    for step in range(start, start + steps):
        torch.manual_seed(100 + step)
        x = torch.randn(8, first.shape[1]).to(first.device)
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()


def _assert_identical(models: list[nn.Module], optimizers: list[LowBitAdam]) -> None:
    weights = [compact_state(model) for model in models]
    for key, value in weights[0].items():
        assert_bitwise_equal(weights[1][key], value)
    reference, grouped = optimizers
    for param, twin in zip(models[0].parameters(), models[1].parameters()):
        state, twin_state = reference.state[param], grouped.state[twin]
        assert set(state) == set(twin_state)
        for key, value in state.items():
            if torch.is_tensor(value):
                assert_bitwise_equal(twin_state[key], value)
            else:
                assert twin_state[key] == value
    assert grouped.rounding_counter == reference.rounding_counter


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_grouped_step_is_the_reference_step_bit_for_bit(level: str, recipe: str, optimizer: str) -> None:
    """Eager, the groups compute every value with the reference's operations on the same
    inputs: weights, moments, scales, masters and noise draws all equal, step after step."""
    models, optimizers = _twins(level, RECIPES[recipe], optimizer)
    _train(models, optimizers, steps=4)
    assert optimizers[1].update_groups, "nothing was grouped"
    _assert_identical(models, optimizers)


@cuda_fp8
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_grouped_step_on_cuda_is_the_reference_step_bit_for_bit(level: str, recipe: str) -> None:
    """The same on a CUDA GPU, both steps eager (on CUDA the default compiles them): the
    groups' buffers, views and noise keys on the device."""
    models, optimizers = _twins(level, RECIPES[recipe], "adamw", device="cuda", fused=False)
    _train(models, optimizers, steps=4)
    assert optimizers[1].update_groups, "nothing was grouped"
    _assert_identical(models, optimizers)


@pytest.mark.parametrize("state_block_size", [0, 64])
def test_grouped_step_with_block_scaled_moments(state_block_size: int) -> None:
    """Moments with one scale per block of 64 elements take rows of 64: still exact."""
    models, optimizers = _twins("O2", amp8.Recipe(), "adamw", state_block_size=state_block_size)
    _train(models, optimizers, steps=3)
    widths = {group.key.width for group in optimizers[1].update_groups if group.key.spec.weight is not WeightKind.PLAIN}
    assert widths == {state_block_size or TENSOR_ROW_WIDTH}
    _assert_identical(models, optimizers)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_operations_per_step_do_not_grow_with_the_parameters(level: str) -> None:
    """The aten operations one step dispatches are the same for 4 and for 40 FP8 layers of
    one shape (with biases and a norm): the work per step is per group, not per parameter."""
    counts = []
    for layers in (4, 40):
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(layers)]
        model, _ = amp8.initialize(nn.Sequential(*blocks, nn.LayerNorm(32)), None, level, amp8.Recipe(), layer_selection="all")
        optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), amp8.LEVELS[level])
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        counts.append(counting.dispatched_operations(optimizer.step))
    assert counts[0] == counts[1], f"operations per step: {counts[0]} for 4 layers, {counts[1]} for 40"


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_only_groups_with_per_tensor_scales_keep_tensor_amaxes(level: str, monkeypatch: Any) -> None:
    """A step keeps each tensor's amaxes (a scatter over its rows) only in groups that
    bound a scale per tensor; a group whose scales are all per row (here the float32
    layer's, with low-bit moments) skips it, and every value still equals the reference
    step's, bit for bit."""
    models, optimizers = _twins(level, amp8.Recipe(), "adamw", layer_selection=_FIRST_LAYER_PLAIN)
    _train(models, optimizers, steps=2)
    groups = optimizers[1].update_groups
    keeping = [group_step.bounds_per_tensor(group.key.spec) for group in groups]
    assert any(keeping) and not all(keeping), [group.key.spec for group in groups]
    x = torch.randn(8, 32)
    for model, optimizer in zip(models, optimizers):
        optimizer.zero_grad()
        model(x).square().mean().backward()
    optimizers[0].step()
    kept: list[int] = []
    keep_amaxes = group_step.keep_amaxes
    monkeypatch.setattr(group_step, "keep_amaxes", lambda tensors, *args: kept.append(len(tensors.draw))
                        or keep_amaxes(tensors, *args))
    optimizers[1].step()
    assert sorted(kept) == sorted(len(group.members) for group, keeps in zip(groups, keeping) if keeps)
    _train(models, optimizers, steps=2, start=3)
    _assert_identical(models, optimizers)


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiled_groups_do_not_recompile_with_an_lr_scheduler(level: str) -> None:
    """One compiled graph per update group, called once per step; 20 steps under a
    cosine schedule compile nothing after the first, whatever the number of layers."""
    from torch._dynamo.utils import counters

    model, _ = amp8.initialize(_model(6), None, level, amp8.Recipe())
    optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), amp8.LEVELS[level], fused=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    for step in range(20):
        optimizer.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a step after the first compiled again"
    groups = optimizer.update_groups
    assert len(optimizer.compiled_specs) == len({group.key.spec for group in groups})
    members = {id(member.param) for group in groups for member in group.members}
    assert all(id(param) in members for param in optimizer.weights) and not optimizer.own_updates


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_groups_are_rebuilt_when_what_they_hold_changes(level: str) -> None:
    """A parameter without a gradient for a step, an optimizer checkpoint loaded, and a
    weight written by hand: each step after still equals the reference's, bit for bit."""
    models, optimizers = _twins(level, amp8.Recipe(), "adamw", layers=3)
    _train(models, optimizers, steps=2)
    for model in models:  # the last layer's weight gets no gradient for one step
        model[4].weight.requires_grad_(False)
    _train(models, optimizers, steps=1, start=2)
    for model in models:
        model[4].weight.requires_grad_(True)
    _train(models, optimizers, steps=1, start=3)
    _assert_identical(models, optimizers)
    for optimizer in optimizers:  # a round trip through a checkpoint
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    with torch.no_grad():
        for model in models:
            model[0].weight.mul_(0.5)
    _train(models, optimizers, steps=2, start=4)
    _assert_identical(models, optimizers)
    for model in models:  # a compact checkpoint assigned: new weights and scale buffers
        with amp8.compact_state_dict(model):
            model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)
    _train(models, optimizers, steps=2, start=6)
    _assert_identical(models, optimizers)


def test_moments_and_weights_live_in_the_group_buffers() -> None:
    """Each parameter's moments and its stored FP16 weight are views into its group's
    buffers, in rows of the group's width; the padding of a tensor's last row stays zero;
    between steps the group holds no copy of the gradients or plain weights."""
    model, _ = amp8.initialize(_model(2), None, "O2", amp8.Recipe())
    optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), amp8.LEVELS["O2"])
    _train([model], [optimizer], steps=2)
    for group in optimizer.update_groups:
        for member in group.members:
            state = optimizer.state[member.param]
            for key in ("exp_avg", "exp_avg_sq"):
                assert state[key]._base is getattr(group.tensors, key)
            if member.handle is not None:
                assert member.handle.data._base is group.tensors.weight
                assert member.handle.stored_scale._base is group.tensors.weight_scale
        used = sum(member.param.numel() for member in group.members)
        assert int(group.tensors.exp_avg.float().ne(0).sum()) <= used
        if group.key.spec.weight is WeightKind.PLAIN:  # copies of the gradients and weights, for a step only
            assert all(copy.device.type == "meta" for copy in (group.tensors.grad, group.tensors.weight))
            assert all(view.untyped_storage().nbytes() == 0 for view in (*group._grad_views, *group._weight_views))
        else:  # the backward wrote each FP8 gradient into the buffer the step read it from
            for member in group.members:
                data, scale, _ = member.param.grad.parts()
                assert data._base is group.tensors.grad and scale._base is group.tensors.grad_scale
        rows = group.tensors.exp_avg.shape[0]
        assert rows == sum(-(-member.param.numel() // group.key.width) for member in group.members)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_every_buffer_a_group_shows_between_steps_can_be_read(level: str) -> None:
    """What ``update_groups`` shows for inspection is safe to read after a step: the
    buffers that hold copies for one step only show as meta tensors of their shapes, not
    as tensors whose memory is gone."""
    model, _ = amp8.initialize(_model(2), None, level, amp8.Recipe())
    optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), amp8.LEVELS[level])
    _train([model], [optimizer], steps=2)
    for group in optimizer.update_groups:
        repr(group.tensors)
        for tensor in group.tensors:
            if tensor is not None and tensor.device.type != "meta":
                assert tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()
                tensor.float().sum()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_compact_checkpoint_gives_each_layer_its_own_memory(level: str) -> None:
    """The weights and scales a group holds are saved as tensors of their own: the
    checkpoint holds each layer's alone, and safetensors takes it."""
    model, _ = amp8.initialize(_model(2), None, level, amp8.Recipe())
    optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), amp8.LEVELS[level])
    _train([model], [optimizer], steps=2)
    with amp8.compact_state_dict(model):
        state = model.state_dict()
    for key, value in state.items():
        assert value.untyped_storage().nbytes() == value.nbytes, key
    loaded = load_safetensors(save_safetensors(state))
    for key, value in state.items():
        assert_bitwise_equal(loaded[key], value)


def test_row_width_follows_the_storage() -> None:
    per_tensor = Layout(torch.float8_e4m3fn)
    rows = Layout(torch.float8_e4m3fn, Tiling.ROWS)
    blocks = Layout(torch.float16, Tiling.BLOCKS, block=32)
    tiles = Layout(torch.float8_e4m3fn, Tiling.TILES, tile=(16, 16))

    def spec(grad: Layout, moment: Layout) -> UpdateSpec:
        return UpdateSpec(grad, moment, moment, WeightKind.FP16_SCALED, Decay.NONE, False, True)

    shape = torch.Size([48, 96])
    assert row_width(spec(per_tensor, per_tensor), shape) == TENSOR_ROW_WIDTH
    assert row_width(spec(per_tensor, per_tensor), torch.Size([48])) == 64  # a bias: no mostly-padding rows
    assert row_width(spec(per_tensor, per_tensor), torch.Size([1])) == 1
    assert row_width(spec(rows, rows), shape) == 96
    assert row_width(spec(per_tensor, blocks), shape) == 32
    assert row_width(spec(rows, blocks), shape) is None
    assert row_width(spec(tiles, per_tensor), shape) is None
    assert row_width(spec(rows, per_tensor), torch.Size([96])) is None


class _CopiedStorages(TorchDispatchMode):
    """The storages every copy operation reads from (its sources), by data pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.pointers: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "copy" in func.__name__ and len(args) > 1:
            self.pointers.update(t.untyped_storage().data_ptr() for t in tree_leaves(args[1])
                                 if isinstance(t, torch.Tensor) and t.device.type != "meta")
        return func(*args, **(kwargs or {}))


# The first layer (32 x 48: 1,536 elements, six rows of 256) stays in float32; the others run in FP8.
_FIRST_LAYER_PLAIN = SpeedRule(min_features=48, min_weight_elements=2000, source="tests: the first layer kept")


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_large_plain_tensor_is_updated_where_it_is(level: str, in_place: bool, monkeypatch: Any) -> None:
    """A plain weight of at least ``IN_PLACE_ELEMENTS`` is a group of its own whose step
    reads its gradient and writes its weight where they are: no copy reads either (below
    the threshold, both are copied into the group's buffers), and every value equals the
    reference step's, bit for bit. Made non-contiguous, the weight goes back to a shared
    group, still exact."""
    if in_place:
        monkeypatch.setattr(plan, "IN_PLACE_ELEMENTS", 1024)
    models, optimizers = _twins(level, amp8.Recipe(), "adamw", layer_selection=_FIRST_LAYER_PLAIN)
    _train(models, optimizers, steps=2)
    weight = models[1][0].weight
    assert type(models[1][0]) is nn.Linear
    owners = [group for group in optimizers[1].update_groups if any(m.param is weight for m in group.members)]
    assert [group.key.own is not None for group in owners] == [in_place]
    x = torch.randn(8, 32)
    for model, optimizer in zip(models, optimizers):
        optimizer.zero_grad()
        model(x).square().mean().backward()
    optimizers[0].step()
    with _CopiedStorages() as copies:
        optimizers[1].step()
    pointers = {weight.untyped_storage().data_ptr(), weight.grad.untyped_storage().data_ptr()}
    assert pointers.isdisjoint(copies.pointers) == in_place
    _assert_identical(models, optimizers)
    with torch.no_grad():
        for model in models:  # same values, transposed memory: no longer contiguous
            model[0].weight.data = model[0].weight.detach().t().contiguous().t()
    _train(models, optimizers, steps=2, start=2)
    assert all(group.key.own is None for group in optimizers[1].update_groups)
    _assert_identical(models, optimizers)


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_compiled_in_place_group_steps_as_a_shared_one(level: str, monkeypatch: Any) -> None:
    """Compiled, the group of one plain tensor updated in place gives the values the
    same tensor gets through a shared group's buffers, bit for bit."""
    runs = []
    for threshold in (1024, plan.IN_PLACE_ELEMENTS):
        monkeypatch.setattr(plan, "IN_PLACE_ELEMENTS", threshold)
        model, _ = amp8.initialize(_model(2), None, level, amp8.Recipe(), layer_selection=_FIRST_LAYER_PLAIN)
        optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                              amp8.LEVELS[level], fused=True)
        _train([model], [optimizer], steps=3)
        assert any(group.key.own is not None for group in optimizer.update_groups) == (threshold == 1024)
        runs.append((compact_state(model), optimizer))
    (weights, in_place), (shared_weights, shared) = runs
    for key, value in shared_weights.items():
        assert_bitwise_equal(weights[key], value)
    for param, twin in zip(in_place.state, shared.state):
        for key, value in shared.state[twin].items():
            if torch.is_tensor(value):
                assert_bitwise_equal(in_place.state[param][key], value)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_an_in_place_group_resumes_from_a_checkpoint_exactly(level: str, monkeypatch: Any) -> None:
    """A checkpoint of a model whose plain weight is updated in place restores bit for bit,
    and the resumed run repeats the uninterrupted one exactly."""
    monkeypatch.setattr(plan, "IN_PLACE_ELEMENTS", 1024)

    def build() -> tuple[nn.Module, LowBitAdam]:
        model, _ = amp8.initialize(_model(2), None, level, amp8.Recipe(), layer_selection=_FIRST_LAYER_PLAIN)
        return model, LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), amp8.LEVELS[level])

    model, optimizer = build()
    _train([model], [optimizer], steps=2)
    assert any(group.key.own is not None for group in optimizer.update_groups)
    resumed_model, resumed_optimizer = assert_checkpoint_round_trips(build, model, optimizer)
    _train([model, resumed_model], [optimizer, resumed_optimizer], steps=2, start=2)
    assert any(group.key.own is not None for group in resumed_optimizer.update_groups)
    for key, value in compact_state(model).items():
        assert_bitwise_equal(compact_state(resumed_model)[key], value)
    for param, twin in zip(model.parameters(), resumed_model.parameters()):
        for key, value in optimizer.state[param].items():
            if torch.is_tensor(value):
                assert_bitwise_equal(resumed_optimizer.state[twin][key], value)


@pytest.mark.parametrize("width, sixteens", [(16, None), (24, None), (32, 2), (48, 3), (1024, 64)])
def test_the_compiled_step_takes_rows_that_are_multiples_of_16_in_sixteens(width: int, sixteens: int | None) -> None:
    """``in_sixteens`` views a group's data buffers as (rows, width / 16, 16) where the
    width is a multiple of 16 (and at least 32), so that the compiled step's kernels know
    it (a GPU kernel then loads and stores several elements with one instruction): the same
    memory; other widths, and every scale and index, as they are."""
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(width, 8, bias=False)), None, "O2", layer_selection="all")
    optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters()), amp8.LEVELS["O2"], fused=False)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    model(torch.randn(4, width)).sum().backward()
    with torch.no_grad():  # as a step gathers its inputs
        assert optimizer._plan is not None and optimizer._plan.gather(plan.step_inputs(optimizer))
        tensors = optimizer.update_groups[0].tensors
        views = group_step.in_sixteens(tensors)
    for name in ("grad", "exp_avg", "exp_avg_sq", "weight"):
        buffer, view = getattr(tensors, name), getattr(views, name)
        expected = buffer.shape if sixteens is None else (buffer.shape[0], sixteens, 16)
        assert view.shape == expected and view.data_ptr() == buffer.data_ptr(), name
        assert torch.equal(view.flatten(1).view(torch.uint8), buffer.view(torch.uint8)), name
    for name in ("grad_scale", "exp_avg_scale", "amaxes", "row_amaxes", "row_tensor", "row_offset", "draw", "steps"):
        assert getattr(views, name) is getattr(tensors, name), name
    optimizer._plan.end_step()
