"""bench/optimizer_kernels.py: the kernels (operators on the CPU) of each optimizer step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_bench

optimizer_kernels = load_bench("optimizer_kernels")


@pytest.mark.slow
@pytest.mark.compile  # LowBitAdam's fused step compiles
def test_optimizer_kernels_lists_what_each_step_runs(tmp_path: Path) -> None:
    path = optimizer_kernels.main(["--device", "cpu", "--millions", "1", "--width", "256", "--levels", "O1",
                                   "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "optimizer_kernels-cpu.json" and record["benchmark"] == "optimizer_kernels"
    torch_row, amp8_row = record["rows"]
    assert (torch_row["run"], amp8_row["run"]) == ("torch AdamW foreach", "amp8 O1")
    assert any(name.startswith("aten::_foreach_") for name in torch_row["kernels"])
    assert any(name.startswith("Torch-Compiled Region") for name in amp8_row["kernels"]), "the compiled update"
    for row in record["rows"]:
        assert row["kernel_calls"] == pytest.approx(sum(k["calls"] for k in row["kernels"].values()))
        assert 0 < row["kernel_ms"] <= 1.05 * row["step_ms"], row  # what the step calls lies within it
