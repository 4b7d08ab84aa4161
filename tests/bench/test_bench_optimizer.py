"""bench/optimizer.py: the square layers it steps over, and one row of its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import load_bench

optimizer_bench = load_bench("optimizer")


@pytest.mark.parametrize("millions, width, layers", [(1, 256, 15), (1, 128, 61), (1, 2048, 1)])
def test_optimizer_layers_hold_the_asked_parameters_and_all_get_gradients(millions: int, width: int,
                                                                           layers: int) -> None:
    stack = optimizer_bench.square_layers(millions, width, torch.device("cpu"))
    assert len(stack) == layers and all(tuple(layer.weight.shape) == (width, width) for layer in stack)
    optimizer_bench.fill_gradients(stack, torch.device("cpu"))
    norms = torch.stack([layer.weight.grad.norm() for layer in stack])
    assert (norms > 0).all() and norms.max() / norms.min() < 1.01, "every layer gets the same nonzero gradient"


@pytest.mark.slow
@pytest.mark.compile  # LowBitAdam's fused step compiles
def test_optimizer_writes_each_row_with_its_compile_seconds(tmp_path: Path) -> None:
    path = optimizer_bench.main(["--device", "cpu", "--sizes", "1", "--widths", "128", "--levels", "O1",
                                 "--repeats", "1", "--no-memory", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "optimizer-cpu.json" and record["torch_adamw"] == "foreach"
    (row,) = record["step_time"]
    assert row["level"] == "O1" and row["width"] == 128 and row["layers"] == 61, row
    assert row["torch_adamw_ms"] > 0 and row["amp8_fused_ms"] > 0 and row["amp8_ms"] > 0, row
    assert row["fused_first_step_s"] >= row["fused_compile_s"] >= 0, row
    assert row["fused_ratio"] == pytest.approx(row["amp8_fused_ms"] / row["torch_adamw_ms"]), row
