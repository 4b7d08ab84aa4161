"""bench/step_kernels.py: a step's kernels (on the CPU, aten operations) by time, with
their kinds and totals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import load_bench

step_kernels = load_bench("step_kernels")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "gemm"),
    ("aten::mm", "gemm"), ("aten::_scaled_mm", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("triton_red_fused__to_copy_abs_amax_cat_transpose_view_14", "triton"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AbsFunctor<float>>", "other"),
    ("aten::copy_", "other"), ("aten::mul", "other"),
])
def test_kernels_are_sorted_into_kinds(name: str, kind: str) -> None:
    assert step_kernels.kernel_kind(name) == kind


@pytest.mark.slow
def test_step_kernels_lists_a_steps_operations_by_time(tmp_path: Path) -> None:
    path = step_kernels.main(["--device", "cpu", "--preset", "tiny", "--run", "amp8 O2", "--mode", "eager",
                              "--batch-size", "2", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    assert path.name == "step_kernels-amp8-o2-eager-cpu.json"
    record = json.loads(path.read_text())
    assert record["torch"] == torch.__version__ and record["run"] == "amp8 O2" and record["mode"] == "eager"
    kernels = record["kernels"]
    times = [row["ms_per_step"] for row in kernels]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    assert {row["kind"] for row in kernels} >= {"gemm", "other"}
    by_kind = record["ms_per_step_by_kind"]
    assert sum(by_kind.values()) == pytest.approx(sum(times))
    assert any(row["kernel"] == "aten::mm" and row["calls_per_step"] >= 1 for row in kernels)


@pytest.mark.slow
def test_step_kernels_converts_a_torchao_run_with_torchao(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchao run goes through torchao's converter (here a stand-in that records its
    call and leaves the model as it is), on any machine."""
    converted: list[str] = []

    def convert(module: torch.nn.Module, recipe: str = "tensorwise", module_filter_fn: object = None) -> torch.nn.Module:
        converted.append(recipe)
        return module

    monkeypatch.setattr(step_kernels, "torchao_float8", lambda: (convert, "available: a stand-in"))
    step_kernels.main(["--device", "cpu", "--preset", "tiny", "--run", "torchao rowwise", "--mode", "eager",
                       "--batch-size", "2", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    assert converted == ["rowwise"]
