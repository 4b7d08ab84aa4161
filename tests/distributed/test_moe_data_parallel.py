"""A mixture of experts over two CPU processes (gloo): amp8's own data parallel at O1-O3
and the user's DistributedDataParallel at O2 average the experts' FP8 gradients, and
every rank ends with the same weights, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import amp8
import multiprocess
from amp8.distributed import register_ddp
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal
from moe_models import tiny_moe_model

STEPS = 3


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """``STEPS`` steps on this rank's own batches; what the experts' gradient was."""
    grad_types = set()
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        experts = model.module[1].experts if hasattr(model, "module") else model[1].experts
        grad_types.add(type(experts.gate_up_proj.grad).__name__)
        optimizer.step()
    return {"grad_types": grad_types}


def _runs(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for level in ("O1", "O2", "O3"):
        model = tiny_moe_model(seed=rank)  # different weights per rank: initialize broadcasts rank 0's
        model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
        stats = optimizer.gradient_average.data_parallel.stats
        stats.bytes_by_kind.clear()
        found[level] = _train(model, optimizer, rank)
        found[level]["bytes_per_step"] = stats.total / STEPS
        found[level]["experts_dtype"] = model[1].experts.gate_up_proj.dtype
        found[level]["state"] = multiprocess.full_state(model)
    model = tiny_moe_model(seed=0)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    ddp = register_ddp(nn.parallel.DistributedDataParallel(model))
    found["ddp"] = _train(ddp, optimizer, rank)
    found["ddp"]["state"] = multiprocess.full_state(model)
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return multiprocess.run(_runs, Path(tmp_path_factory.mktemp("moe-dp")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["O1", "O2", "O3", "ddp"])
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
def test_o3_in_a_process_group_keeps_the_experts_unsharded_as_they_are(results: list[dict[str, Any]]) -> None:
    """O3's sharded optimizer shards the FP8 layers' weights only: the experts stay in
    their own dtype, replicated, their gradients averaged with the other parameters'."""
    assert results[0]["O3"]["experts_dtype"] == torch.float32
    assert results[0]["O3"]["grad_types"] == {"Tensor"}
