"""bench/static_shapes.py: amp8's compiled functions, dynamic against static shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import load_bench

static_shapes = load_bench("static_shapes")


def test_moved_bytes_counts_reads_in_place_writes_and_outputs() -> None:
    read, written, ignored = torch.zeros(10), torch.zeros(4), 3

    def fn(a: torch.Tensor, b: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        b.add_(1)
        return a * 2, b  # a new tensor, and one handed in

    assert static_shapes.moved_bytes(fn, (read, written, ignored)) == 4 * (10 + 4) + 4 * 4 + 4 * 10


@pytest.mark.slow
@pytest.mark.compile  # both variants of every function compile
def test_static_shapes_compares_every_compiled_function(tmp_path: Path) -> None:
    path = static_shapes.main(["--device", "cpu", "--tokens", "32", "--width", "32", "--mlp", "2", "--millions", "1",
                               "--levels", "O2", "--repeats", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "static_shapes-cpu.json" and record["benchmark"] == "static_shapes"
    cases = [row["case"] for row in record["rows"]]
    assert cases[0] == "O2 group update", cases
    # The forward's input casts, the backward's output-gradient casts, the weight gradients' quantizations.
    assert sum(case.startswith("scaled_cast") for case in cases) >= 4, cases
    assert sum(case.startswith("_quantized") for case in cases) == 2, cases
    update = record["rows"][0]
    assert 8 <= update["bytes_per_parameter"] <= 16, update  # FP8 grad and moments, FP16 weights and second moments
    for row in record["rows"]:
        assert row["dynamic"]["ms"] > 0 and row["static"]["ms"] > 0, row
