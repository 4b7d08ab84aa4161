"""bench/linear_kernels.py: the least a layer must do, and the kernels of eager and compiled layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_bench

linear_kernels = load_bench("linear_kernels")


def test_linear_kernels_least_counts_each_operand_once() -> None:
    m, k, n = 2, 3, 5
    least = linear_kernels.least(m, k, n, input_bytes=2)
    # forward: x read (12 B) and written twice in FP8 (12), x8 and W8 read (6 + 15), y written (20)
    assert least["forward"] == {"kernels": 2, "bytes": 12 + 12 + 6 + 15 + 20}
    # backward: dy read (20) and written twice (20), dgrad reads dy8 and W8 (10 + 15) and writes dx (12),
    # wgrad reads x8 and dy8 (6 + 10) and writes dW in FP8 (15)
    assert least["backward"] == {"kernels": 3, "bytes": 20 + 20 + 10 + 15 + 12 + 6 + 10 + 15}


@pytest.mark.slow
@pytest.mark.compile
def test_linear_kernels_counts_eager_and_compiled_layers(tmp_path: Path) -> None:
    path = linear_kernels.main(["--shape", "16", "32", "32", "--levels", "O2", "--recipes", "tensorwise",
                                "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "linear_kernels-cpu.json" and record["benchmark"] == "linear_kernels"
    eager_ops, eager, compiled = record["rows"]
    assert (eager_ops["mode"], eager["mode"], compiled["mode"]) == ("eager-ops", "eager", "compiled")
    for phase in ("forward", "backward"):
        assert eager_ops[phase]["graph_calls"] == 0 and compiled[phase]["graph_calls"] >= 1, phase
        assert eager[phase]["graph_calls"] >= 1, phase  # amp8's compiled casts
        assert eager_ops[phase]["kernels"] > eager[phase]["kernels"] >= record["least"][phase]["kernels"], phase
        assert eager_ops[phase]["kernels"] > compiled[phase]["kernels"] >= record["least"][phase]["kernels"], phase
        assert eager_ops[phase]["fp8_flops"] == eager[phase]["fp8_flops"] == compiled[phase]["fp8_flops"] > 0, phase
    assert all(row["first_step_s"] > 0 for row in record["rows"])
