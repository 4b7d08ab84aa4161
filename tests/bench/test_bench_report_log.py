"""bench/report_log.py: the log's share of a training step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_bench


def test_report_log_bench_writes_the_logs_share_of_a_step(tmp_path: Path) -> None:
    bench = load_bench("report_log")
    path = bench.main(["--preset", "tiny", "--repeats", "1", "--levels", "O1", "--every", "10", "--out", str(tmp_path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["plain_step_s"] > 0 and row["record_s"] > 0 and row["every"] == 10
    assert row["share_of_step"] == pytest.approx(bench.share_of_step(row, 10))
