"""bench/optimizer_host.py: a fixed number of operations per grouped step, every row written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import load_bench

optimizer_host = load_bench("optimizer_host")


def test_optimizer_host_counts_a_fixed_number_of_operations(tmp_path: Path) -> None:
    """bench/optimizer_host.py, eager rows only: the grouped step dispatches as many
    operations for 6 layers as for 2, the per-tensor step more, and every row is written."""
    path = optimizer_host.main(["--layers", "2", "6", "--repeats", "1", "--no-compile", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["benchmark"] == "optimizer_host" and record["torch"] == torch.__version__
    small, large = record["rows"]
    for level in optimizer_host.LEVELS:
        assert small[f"{level}_grouped_ops"] == large[f"{level}_grouped_ops"], level
        assert small[f"{level}_per_tensor_ops"] < large[f"{level}_per_tensor_ops"], level
        assert large[f"{level}_grouped_ms"] > 0 and f"{level}_grouped_compiled_ms" not in large
