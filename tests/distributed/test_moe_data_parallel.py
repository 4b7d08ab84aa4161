"""A mixture of experts over two CPU processes (gloo): amp8's own data parallel at O1-O3
and the user's DistributedDataParallel at O2 average the experts' FP8 gradients, and
every rank ends with the same weights, bit for bit; O3 shards the experts' FP8 weights
and their optimizer state by expert (FSDP2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import amp8
import multiprocess
from amp8.distributed import register_ddp
from amp8.quant.scaling import sqnr
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal, compact_state
from moe_models import tiny_moe_model

STEPS = 3


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's 16 tokens of ``step``; for one process (``world`` 1), both ranks'."""
    ranks = [rank] if world > 1 else [0, 1]
    return torch.cat([torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + r)) for r in ranks])


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int = 2, steps: range = range(STEPS),
) -> dict[str, Any]:
    """``steps`` on this rank's own batches; the losses and what the experts' gradient was."""
    grad_types, losses = set(), []
    for step in steps:
        optimizer.zero_grad()
        loss = model(_batch(step, rank, world)).pow(2).mean()
        loss.backward()
        experts = _unwrapped(model)[1].experts
        grad_types.add(type(experts.gate_up_proj.grad).__name__)
        optimizer.step()
        losses.append(loss.item())
    return {"grad_types": grad_types, "losses": losses}


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrapper."""
    return getattr(model, "module", getattr(model, "_orig_mod", model))


def _o3(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """O3 with one scale per tensor (per expert for the experts): the default in a process
    group, where O3 shards the optimizer; asked for explicitly in one process."""
    model = tiny_moe_model(seed=seed)
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O3", recipe=amp8.Recipe())


def _held_experts(model: nn.Module) -> torch.Tensor:
    """The experts' weights as the model holds them (FP8 at O3), real values, flat."""
    return torch.cat([handle.read().flatten() for handle in model[1].experts.stored_weights()])


def _o3_checkpoint(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Save a sharded O3 MoE after 3 steps, go on 3 steps; resume from the checkpoint
    in a new model and optimizer and take the same 3 steps."""
    model, optimizer = _o3()
    _train(model, optimizer, rank)

    def state(m: nn.Module, o: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": m.state_dict(), "optimizer": {f"rank{rank}": o.state_dict()}}

    dcp.save(state(model, optimizer), checkpoint_id=f"{folder}/o3")
    saved = multiprocess.full_state(model)
    later = range(STEPS, 2 * STEPS)
    uninterrupted = _train(model, optimizer, rank, steps=later)["losses"]
    resumed_model, resumed_optimizer = _o3(seed=1)
    target = state(resumed_model, resumed_optimizer)
    dcp.load(target, checkpoint_id=f"{folder}/o3")
    resumed_model.load_state_dict(target["model"])
    resumed_optimizer.load_state_dict(target["optimizer"][f"rank{rank}"])
    resumed = _train(resumed_model, resumed_optimizer, rank, steps=later)["losses"]
    return {"uninterrupted": uninterrupted, "resumed": resumed, "saved": saved}


def _runs(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for level in ("O1", "O2", "O3"):
        model = tiny_moe_model(seed=rank)  # different weights per rank: initialize broadcasts rank 0's
        model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
        stats = optimizer.gradient_average.data_parallel.stats
        stats.bytes_by_kind.clear()
        found[level] = _train(model, optimizer, rank)
        found[level]["bytes_per_step"] = stats.total / STEPS
        experts = model[1].experts
        found[level]["experts_dtype"] = experts.stored_weights()[0].data.dtype  # as stored
        found[level]["experts_rows"] = [handle.local_rows() for handle in experts.stored_weights()]
        found[level]["master_numel"] = [
            optimizer.master_weight(handle.param).numel() for handle in experts.stored_weights()
        ] if level == "O3" else None
        found[level]["loss_after"] = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(7))).pow(2).mean()
        found[level]["report"] = amp8.report(model, optimizer).to_dict()
        if level == "O3":
            try:
                amp8.export(model, optimizer)
            except ValueError as error:
                found["export_error"] = str(error)
        found[level]["state"] = multiprocess.full_state(model)
    # O3 with the experts as its only FP8 modules: export must still see the sharding.
    model = tiny_moe_model(seed=0)
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters()), "O3", module_filter=lambda module, fqn: "experts" in fqn
    )
    try:
        amp8.export(model, optimizer)
    except ValueError as error:
        found["experts_export_error"] = str(error)
    # Three experts over two ranks: FSDP2 gives rank 0 two of them, rank 1 one.
    model = tiny_moe_model(num_experts=3, seed=rank)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O3")
    found["O3-uneven"] = _train(model, optimizer, rank)
    found["O3-uneven"]["experts_rows"] = [handle.local_rows() for handle in model[1].experts.stored_weights()]
    found["O3-uneven"]["state"] = multiprocess.full_state(model)
    model = tiny_moe_model(seed=0)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    ddp = register_ddp(nn.parallel.DistributedDataParallel(model))
    found["ddp"] = _train(ddp, optimizer, rank)
    found["ddp"]["state"] = multiprocess.full_state(model)
    return found


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """O0 and O3 (one scale per tensor, as O3 in a process group) in one process on
    both ranks' batches."""
    found = {}
    for level in ("O0", "O3"):
        model = tiny_moe_model(seed=0)
        model, optimizer = amp8.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=amp8.Recipe()
        )
        found[level] = {**_train(model, optimizer, 0, world=1), "state": compact_state(model)}
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return multiprocess.run(_runs, Path(tmp_path_factory.mktemp("moe-dp")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["O1", "O2", "O3", "O3-uneven", "ddp"])
def test_every_rank_ends_with_the_same_experts(results: list[dict[str, Any]], run: str) -> None:
    first, second = (rank[run]["state"] for rank in results)
    assert first.keys() == second.keys()
    # The weights and their scales; the FP8 layers' activation records are each rank's own.
    weights = [key for key in first if not key.endswith((".scale", ".amax_history"))]
    assert any("experts" in key for key in weights)
    for key in weights:
        assert_bitwise_equal(first[key], second[key])


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["O1", "O2", "ddp"])
def test_expert_gradients_are_fp8_and_go_over_the_wire_in_fp8(results: list[dict[str, Any]], run: str) -> None:
    assert results[0][run]["grad_types"] == {WeightGrad.__name__}
    if run != "ddp":
        assert results[0][run]["experts_dtype"] == torch.float16
        numel = sum(p.numel() for p in tiny_moe_model().parameters())
        # An FP8 all-reduce sends each element about twice (reduce-scatter, all-gather)
        # at one byte, plus scales; FP32 would send 8 bytes per element.
        assert results[0][run]["bytes_per_step"] <= 2.5 * numel, results[0][run]["bytes_per_step"]


@pytest.mark.multiprocess
def test_o3_in_a_process_group_shards_the_experts_weights_and_masters_by_expert(
    results: list[dict[str, Any]],
) -> None:
    """16 experts over two ranks: each rank stores 8 experts' FP8 weights and FP16
    masters; the gradient never reaches ``.grad`` (FSDP2 would reduce it in its own
    dtype) but is reduce-scattered in FP8, and both ranks compute the same model."""
    gate_up, down = tiny_moe_model()[1].experts.parameters()
    for rank, found in enumerate(results):
        o3 = found["O3"]
        assert o3["experts_dtype"] == torch.float8_e4m3fn
        assert o3["experts_rows"] == [(8 * rank, 8 * rank + 8)] * 2
        assert o3["master_numel"] == [gate_up.numel() // 2, down.numel() // 2]
        assert o3["grad_types"] == {"NoneType"}
    assert [found["O3-uneven"]["experts_rows"] for found in results] == [[(0, 2)] * 2, [(2, 3)] * 2]
    assert_bitwise_equal(results[0]["O3"]["loss_after"], results[1]["O3"]["loss_after"])
    numel = sum(p.numel() for p in tiny_moe_model().parameters())
    # Per element about a byte reduce-scattered and two gathered (forward and backward):
    # FP32 would send 4 bytes for the reduce-scatter alone.
    assert results[0]["O3"]["bytes_per_step"] <= 3.5 * numel, results[0]["O3"]["bytes_per_step"]


@pytest.mark.multiprocess
def test_sharded_o3_experts_track_one_process_on_the_concatenated_batch(
    results: list[dict[str, Any]], one_process: dict[str, Any]
) -> None:
    """Two ranks against one process at O3 and at O0 on the same 32 tokens a step: the
    experts' weights after the steps stay as close to the one-process runs as FP8 noise
    allows (SQNR floor 25 dB, as for dense layers)."""
    model, _ = _o3()
    model.load_state_dict(results[0]["O3"]["state"])
    two_ranks = _held_experts(model)
    reference, _ = _o3()
    reference.load_state_dict(one_process["O3"]["state"])
    assert sqnr(_held_experts(reference), two_ranks) >= 25.0
    fp32 = torch.cat([one_process["O0"]["state"][f"1.experts.{name}"].flatten() for name in ("gate_up_proj", "down_proj")])
    assert sqnr(fp32, two_ranks) >= 25.0


@pytest.mark.multiprocess
def test_sharded_o3_experts_report_their_own_rows_and_refuse_export(results: list[dict[str, Any]]) -> None:
    """The report counts each rank's 8 experts: an FP8 weight, FP16 master, FP8 first
    and FP16 second moments (no gradient after the step) and all 16 experts' scales."""
    gate_up, down = tiny_moe_model()[1].experts.parameters()
    rows = {row["name"]: row for row in results[0]["O3"]["report"]["rows"]}
    for name, param in (("1.experts.gate_up_proj", gate_up), ("1.experts.down_proj", down)):
        row = rows[name]
        assert (row["weight"], row["master"], row["exp_avg"]) == ("float8_e4m3fn", "float16", "float8_e4m3fn")
        local = param.numel() // 2
        assert local * 6 <= row["bytes"] <= local * 6 + 16 * 4 + local // 8, row["bytes"]
    assert "sharded over data-parallel ranks" in results[0]["export_error"]
    assert results[0]["experts_export_error"].startswith("1.experts.gate_up_proj is sharded over data-parallel ranks")


@pytest.mark.multiprocess
def test_sharded_o3_moe_checkpoint_resumes_identically(tmp_path: Path) -> None:
    results = multiprocess.run(_o3_checkpoint, tmp_path, str(tmp_path))
    for result in results:
        assert result["resumed"] == result["uninterrupted"]
    # The sharded checkpoint loads whole into a model in one process (no process group).
    model, _ = _o3(seed=1)
    target = {"model": compact_state(model)}  # the form the sharded model saved
    dcp.load(target, checkpoint_id=f"{tmp_path}/o3")
    model.load_state_dict(target["model"])
    for key, value in compact_state(model).items():
        if not key.endswith((".scale", ".amax_history")):  # the FP8 layers' activation records are each rank's own
            assert_bitwise_equal(value, results[0]["saved"][key])


def _compiled_o3(rank: int, world: int) -> dict[bool, list[float]]:
    """Sharded O3 losses, eager and under ``torch.compile``, from the same start."""
    losses = {}
    for compiled in (False, True):
        model, optimizer = _o3()
        losses[compiled] = _train(torch.compile(model) if compiled else model, optimizer, rank)["losses"]
    return losses


@pytest.mark.compile
@pytest.mark.multiprocess
def test_sharded_o3_moe_trains_the_same_compiled(tmp_path: Path) -> None:
    """The experts run eagerly inside the compiled model, FSDP2's gathers around them:
    the compiled run takes the eager run's steps exactly."""
    for losses in multiprocess.run(_compiled_o3, tmp_path):
        assert losses[True] == losses[False]
