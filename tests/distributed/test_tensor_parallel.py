"""Tensor parallelism with amp8's styles (``Fp8ColwiseParallel`` -> ``Fp8RowwiseParallel``)
on 2 and 4 CPU processes over gloo, against an FP32 one-process reference and the
one-process amp8 run; one launch per world size serves every case."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import amp8
from amp8.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, GradientReduction, WireStats, data_parallel_group
from amp8.quant.scaling import sqnr
from conftest import mlp
from multiprocess import run

LEVELS = ("O1", "O2")
RECIPES = {"rowwise": lambda: amp8.Recipe.preset("rowwise"), "tensorwise": amp8.Recipe}
LAYOUTS = ("replicated", "sequence")
WORLDS = (2, 4)
BATCH, SEQUENCE, HIDDEN, FFN = 2, 8, 64, 128
STEPS = 3
# Training runs at both levels on two ranks, at O2 on four (the test time budget).
TRAINED_LEVELS = {2: LEVELS, 4: ("O2",)}
MESH_2D = (2, 2)
"""Data parallel x tensor parallel on the four-rank launch: rank = dp * 2 + tp."""
TRAINING_CASES = [(world, level, layout) for world in WORLDS for level in TRAINED_LEVELS[world] for layout in LAYOUTS]


def _plan(layout: str, stats: WireStats | None = None) -> dict[str, Any]:
    if layout == "sequence":
        return {
            "0": Fp8ColwiseParallel(input_layouts=Shard(1), wire_stats=stats),
            "2": Fp8RowwiseParallel(output_layouts=Shard(1), wire_stats=stats),
        }
    return {"0": Fp8ColwiseParallel(wire_stats=stats), "2": Fp8RowwiseParallel(wire_stats=stats)}


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQUENCE, HIDDEN, generator=generator)
    return x, torch.randn(BATCH, SEQUENCE, HIDDEN, generator=generator)


def _amp8(level: str, recipe: str, mesh: Any) -> nn.Module:
    model, _ = amp8.initialize(
        mlp(HIDDEN, FFN, HIDDEN), None, level, recipe=RECIPES[recipe](),
        process_group=mesh["dp"].get_group(), layer_selection="all",
    )
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each linear layer's weight and bias gradients, in float32 (FP8 weight gradients
    dequantized)."""
    grads = {}
    for index in ("0", "2"):
        layer = model.get_submodule(index)
        weight_grad = getattr(layer, "weight_grad", None)
        grads[f"{index}.weight"] = weight_grad.dequantize() if weight_grad is not None else layer.weight.grad.float()
        grads[f"{index}.bias"] = layer.bias.grad.float()
    return grads


def _forward_backward(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * g).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, **_grads(model)}


def _sequence_chunk(t: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    return t.chunk(world, dim=1)[rank] if layout == "sequence" else t


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for index in ("0", "2"):
        layer = model.get_submodule(index)
        out[f"{index}.weight"] = layer.read_weight() if hasattr(layer, "read_weight") else layer.weight.float()
        out[f"{index}.bias"] = layer.bias.detach().float().clone()
    return out


def _train(model: nn.Module, level: str, rank: int, world: int, layout: str) -> list[float]:
    optimizer = amp8.optim.LowBitAdam(model.parameters(), level=level, lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, target = _data(100 + step)
        y = model(_sequence_chunk(x, rank, world, layout))
        local = (y - _sequence_chunk(target, rank, world, layout)).pow(2).sum() / target.numel()
        loss = local.detach().clone()
        if layout == "sequence":  # each rank holds its tokens' part of the loss
            dist.all_reduce(loss)
        losses.append(float(loss))
        local.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _train_2d(level: str) -> dict[str, Any]:
    """Train on a (data parallel, tensor parallel) mesh: each data-parallel rank takes its
    half of every batch, amp8 averages the FP8 gradients over the data-parallel group."""
    mesh = init_device_mesh("cpu", MESH_2D, mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model, _ = amp8.initialize(
        mlp(HIDDEN, FFN, HIDDEN), None, level, recipe=RECIPES["rowwise"](),
        process_group=mesh["dp"].get_group(), layer_selection="all",
    )
    parallelize_module(model, mesh["tp"], _plan("replicated"))
    optimizer = amp8.optim.LowBitAdam(model.parameters(), level=level, lr=1e-2)
    GradientReduction.attach(optimizer, data_parallel_group(model))
    losses = []
    for step in range(STEPS):
        x, target = (t.chunk(MESH_2D[0])[dp_rank] for t in _data_2d(100 + step))
        loss = (model(x) - target).pow(2).mean()
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "weights": _weights(model)}


def _data_2d(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the data-parallel ranks' micro-batches together."""
    pieces = [_data(seed * MESH_2D[0] + part) for part in range(MESH_2D[0])]
    return torch.cat([x for x, _ in pieces]), torch.cat([t for _, t in pieces])


def _error(action: Any) -> str:
    try:
        action()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _worker(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    results: dict[str, Any] = {"cases": {}, "training": {}}
    x, g = _data(0)
    for level in LEVELS:
        for recipe in RECIPES:
            one_process = _forward_backward(_amp8(level, recipe, mesh), x, g) if rank == 0 else None
            for layout in LAYOUTS:
                stats = WireStats()
                model = parallelize_module(_amp8(level, recipe, mesh), mesh["tp"], _plan(layout, stats))
                local = _forward_backward(
                    model, _sequence_chunk(x, rank, world, layout), _sequence_chunk(g, rank, world, layout)
                )
                results["cases"][(level, recipe, layout)] = {
                    "tp": local, "one_process": one_process, "wire": dict(stats.bytes_by_kind),
                }
        for layout in LAYOUTS if level in TRAINED_LEVELS[world] else ():
            tp = parallelize_module(_amp8(level, "rowwise", mesh), mesh["tp"], _plan(layout))
            results["training"][(level, layout)] = {"tp_losses": _train(tp, level, rank, world, layout),
                                                    "tp": _weights(tp)}
            if rank == 0:
                one = _amp8(level, "rowwise", mesh)
                results["training"][(level, layout)].update(
                    one_process_losses=_train(one, level, 0, 1, "replicated"), one_process=_weights(one)
                )
    if world == 4:
        results["2d"] = {level: _train_2d(level) for level in LEVELS}
    if world == 2:
        results["errors"] = {
            "alignment": _error(lambda: parallelize_module(
                amp8.initialize(mlp(HIDDEN, 48), None, "O2", process_group=mesh["dp"].get_group(),
                                layer_selection="all")[0], mesh["tp"], {"0": Fp8ColwiseParallel()})),
            "o3": _error(lambda: parallelize_module(_amp8("O3", "tensorwise", mesh), mesh["tp"], _plan("replicated"))),
            "module": _error(lambda: parallelize_module(_amp8("O2", "rowwise", mesh), mesh["tp"],
                                                        {"1": Fp8ColwiseParallel()})),
        }
    return results


class Launches:
    """The ranks' results of one launch per world size, launched when a test first asks."""

    def __init__(self, folders: pytest.TempPathFactory) -> None:
        self.folders = folders
        self.results: dict[int, list[Any]] = {}

    def __getitem__(self, world: int) -> list[Any]:
        if world not in self.results:
            self.results[world] = run(_worker, self.folders.mktemp(f"tp{world}"), world=world)
        return self.results[world]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory)


SHARD_DIM = {"0.weight": 0, "0.bias": 0, "2.weight": 1}


def _whole(pieces: list[dict[str, torch.Tensor]], key: str, layout: str) -> torch.Tensor:
    """One tensor of the ranks' pieces: sharded weights and sequence-sharded activations
    concatenated, replicated ones taken from rank 0 after checking the others match."""
    if key in SHARD_DIM:
        return torch.cat([piece[key] for piece in pieces], dim=SHARD_DIM[key])
    if layout == "sequence" and key in ("y", "x_grad"):
        return torch.cat([piece[key] for piece in pieces], dim=1)
    for rank, piece in enumerate(pieces[1:], start=1):
        torch.testing.assert_close(piece[key], pieces[0][key], atol=0, rtol=0, msg=f"{key} differs on rank {rank}")
    return pieces[0][key]


def _fp32_reference() -> dict[str, torch.Tensor]:
    reference = mlp(HIDDEN, FFN, HIDDEN)
    x, g = _data(0)
    return _forward_backward(reference, x, g)


FLOORS = {"y": 18.0, "x_grad": 17.0, "0.weight": 17.0, "2.weight": 17.0, "0.bias": 17.0, "2.bias": 17.0}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"world{world}")
def test_outputs_and_gradients_match_one_process(
    launches: Launches, world: int, level: str, recipe: str, layout: str
) -> None:
    results = launches[world]
    cases = [result["cases"][(level, recipe, layout)] for result in results]
    reference, one_process = _fp32_reference(), cases[0]["one_process"]
    for key, floor in FLOORS.items():
        whole = _whole([case["tp"] for case in cases], key, layout)
        against_fp32 = sqnr(reference[key], whole)
        assert against_fp32 >= floor, f"{key}: {against_fp32:.1f} dB against FP32, floor {floor}"
        # Shards are cast at least as finely as the whole: about as close to FP32 as one process.
        assert against_fp32 >= min(sqnr(reference[key], one_process[key]), 60.0) - 1.5, f"{key} worse than one process"
        assert sqnr(one_process[key], whole) >= floor, f"{key} far from the one-process amp8 run"


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"world{world}")
def test_sequence_parallel_gathers_fp8_bytes(launches: Launches, world: int, recipe: str) -> None:
    results = launches[world]
    wire = results[0]["cases"][("O2", recipe, "sequence")]["wire"]
    tokens = BATCH * SEQUENCE // world
    scale_bytes = 0 if recipe == "tensorwise" else 4 * tokens  # one float32 scale per token
    assert wire["all_gather_sequence"] == (tokens * HIDDEN + scale_bytes) * (world - 1)
    bf16 = 2 * tokens * HIDDEN * (world - 1)
    assert wire["all_gather_sequence"] / bf16 <= 0.55
    assert ("amax_all_reduce" in wire) == (recipe == "tensorwise")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "level", "layout"), TRAINING_CASES,
                         ids=[f"world{w}-{level}-{layout}" for w, level, layout in TRAINING_CASES])
def test_training_follows_one_process(launches: Launches, world: int, level: str, layout: str) -> None:
    results = launches[world]
    runs = [result["training"][(level, layout)] for result in results]
    for rank, one in enumerate(runs[1:], start=1):
        assert one["tp_losses"] == runs[0]["tp_losses"], f"rank {rank} saw other losses"
    one_losses, tp_losses = runs[0]["one_process_losses"], runs[0]["tp_losses"]
    torch.testing.assert_close(torch.tensor(tp_losses), torch.tensor(one_losses), rtol=2e-2, atol=0,
                               msg=lambda text: f"losses {tp_losses} against one process {one_losses}: {text}")
    assert tp_losses[-1] < tp_losses[0], f"losses did not fall: {tp_losses}"
    for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
        whole = _whole([run_["tp"] for run_ in runs], key, "replicated")
        assert sqnr(runs[0]["one_process"][key], whole) >= 25.0, f"{key} trained away from one process"


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", LEVELS)
def test_tensor_parallel_inside_data_parallel_follows_one_process(launches: Launches, level: str) -> None:
    """(2, 2) mesh: ranks of one tensor-parallel slot end with identical parameters, and
    the whole model with those of one process trained on the whole batches."""
    runs = [result["2d"][level] for result in launches[4]]
    tp_size = MESH_2D[1]
    for rank in range(tp_size, len(runs)):  # the same tensor-parallel shard on another data-parallel rank
        for key, value in runs[rank]["weights"].items():
            torch.testing.assert_close(value, runs[rank % tp_size]["weights"][key], atol=0, rtol=0,
                                       msg=f"{key} differs between data-parallel ranks {rank % tp_size} and {rank}")
    one = amp8.initialize(mlp(HIDDEN, FFN, HIDDEN), None, level, recipe=RECIPES["rowwise"](), layer_selection="all")[0]
    optimizer = amp8.optim.LowBitAdam(one.parameters(), level=level, lr=1e-2)
    one_losses = []
    for step in range(STEPS):
        x, target = _data_2d(100 + step)
        loss = (one(x) - target).pow(2).mean()
        one_losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    mean_losses = torch.tensor([run_["losses"] for run_ in runs]).mean(dim=0)  # each data-parallel half's mean
    torch.testing.assert_close(mean_losses, torch.tensor(one_losses), rtol=2e-2, atol=0)
    one_weights = _weights(one)
    for key in one_weights:
        whole = _whole([run_["weights"] for run_ in runs[:tp_size]], key, "replicated")
        assert sqnr(one_weights[key], whole) >= 25.0, f"{key} trained away from one process"


@pytest.mark.multiprocess
def test_bad_plans_fail_naming_the_fix(launches: Launches) -> None:
    errors = launches[2][0]["errors"]
    assert "shards of 24, not a multiple of 16" in errors["alignment"]
    assert "supports O1 and O2" in errors["o3"] and "opt_level='O2'" in errors["o3"]
    assert errors["module"].startswith("TypeError") and "got GELU" in errors["module"]


# -- one process -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("style", "option", "layout", "message"),
    [
        (Fp8ColwiseParallel, "input_layouts", Shard(-1), r"input_layouts=Shard\(dim=-1\) is not supported here; use "
         r"Replicate\(\) or Shard\(1\)"),
        (Fp8ColwiseParallel, "output_layouts", Shard(1), r"use Replicate\(\) or Shard\(-1\)"),
        (Fp8RowwiseParallel, "input_layouts", Shard(1), r"use Replicate\(\) or Shard\(-1\)"),
        (Fp8RowwiseParallel, "output_layouts", Shard(-1), r"use Replicate\(\) or Shard\(1\)"),
    ],
)
def test_styles_refuse_layouts_they_cannot_run(style: type, option: str, layout: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        style(**{option: layout})


def test_a_weight_replaced_behind_amp8_names_its_tensor_parallel_styles() -> None:
    """What a stock style (or fully_shard) that swaps the weight Parameter meets."""
    model, _ = amp8.initialize(mlp(32, 64), None, "O2", layer_selection="all")
    model[0].weight = nn.Parameter(model[0].weight.detach().float())
    with pytest.raises(RuntimeError, match="amp8.distributed.Fp8ColwiseParallel and Fp8RowwiseParallel"):
        model(torch.randn(4, 32))


def test_narrow_weight_keeps_the_rows_at_their_scale() -> None:
    model, _ = amp8.initialize(mlp(32, 64), None, "O2", layer_selection="all")
    layer = model[0]
    whole = layer.read_weight()
    layer.narrow_weight(0, 16, 32)
    torch.testing.assert_close(layer.read_weight(), whole[16:48], atol=0, rtol=0)
    assert amp8.tensor.stored_weight(layer.weight) is layer.stored_weight
