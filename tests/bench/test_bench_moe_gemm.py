"""bench/moe_gemm.py: every variant timed side by side; the variants compute the same experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from amp8.nn import Fp8Linear
from amp8.quant.scaling import sqnr
from conftest import load_bench


@pytest.mark.slow  # a benchmark run end to end (its quick case)
def test_moe_gemm_quick_times_every_variant_side_by_side(tmp_path: Path) -> None:
    moe_gemm = load_bench("moe_gemm")
    path = moe_gemm.main(["--quick", "--device", "cpu", "--warmup", "0", "--rounds", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "moe-gemm-cpu.json" and record["baseline"] == moe_gemm.BASELINE
    (row,) = record["rows"]
    variants = {moe_gemm.BASELINE, moe_gemm.GROUPED, *moe_gemm.CANDIDATES}
    dense = {moe_gemm.DENSE, *moe_gemm.DENSE_FP8}
    assert set(row["ms"]) == variants | dense and all(ms > 0 for ms in row["ms"].values())
    assert set(row["ratio_to_baseline"]) == variants - {moe_gemm.BASELINE}
    assert set(row["dense_fp8_ratio"]) == set(moe_gemm.DENSE_FP8)
    for recipe, over in row["experts_over_dense"].items():
        expected = row["ratio_to_baseline"][f"Fp8Experts {recipe}"] / row["dense_fp8_ratio"][f"dense Fp8Linear {recipe}"]
        assert over == pytest.approx(expected)


def test_moe_gemm_variants_compute_the_same_experts() -> None:
    moe_gemm = load_bench("moe_gemm")
    torch.manual_seed(0)
    loop = moe_gemm.LoopExperts(4, 32, 16)
    grouped = moe_gemm.GroupedExperts(4, 32, 16)
    grouped.load_state_dict(loop.state_dict())
    index, weights = moe_gemm.routing(24, 4, 2, "skewed", torch.device("cpu"))
    x = torch.randn(24, 32)
    torch.testing.assert_close(grouped(x, index, weights), loop(x, index, weights), atol=1e-5, rtol=1e-5,
                               msg="the grouped reference computes the loop's experts")


def test_moe_gemm_dense_yardstick_runs_the_experts_shapes_and_its_fp8_copy_the_same_weights() -> None:
    moe_gemm = load_bench("moe_gemm")
    torch.manual_seed(0)
    mlp = moe_gemm.DenseMlp(32, 16)
    assert tuple(mlp.gate_up.weight.shape) == (32, 32) and tuple(mlp.down.weight.shape) == (32, 16)
    rows = torch.randn(24, 32)
    for recipe in moe_gemm.RECIPES.values():
        fp8 = moe_gemm.fp8_mlp(mlp, recipe)
        assert isinstance(fp8.gate_up, Fp8Linear) and fp8.gate_up.weight_storage is moe_gemm.STORAGE
        assert sqnr(mlp(rows), fp8(rows)) > 20.0, "the FP8 copy computes the same MLP"
