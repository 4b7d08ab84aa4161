"""bench/records.py: a result record replaces its file whole."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import load_bench

records = load_bench("records")


def test_write_result_replaces_the_file_whole(tmp_path: Path) -> None:
    device = torch.device("cpu")
    records.write_result("probe", device, {"rows": [1]}, tmp_path)
    path = records.write_result("probe", device, {"rows": [1, 2]}, tmp_path)
    assert json.loads(path.read_text())["rows"] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe-cpu.json"], "no partial file is left"
