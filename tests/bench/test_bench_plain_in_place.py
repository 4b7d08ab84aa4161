"""bench/plain_in_place.py: a tied table stepped in place against copied, one row per level."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from amp8.optim import plan
from conftest import load_bench

plain_in_place = load_bench("plain_in_place")


def test_plain_in_place_times_both_and_records_what_a_step_holds(tmp_path: Path) -> None:
    """Eager rows at a tiny size (the threshold lowered to it for the run): both steps
    timed, and the copied table's step holds its gradient and weight copies (8 bytes an
    element) that the in-place step does not; amp8's threshold is as it was after."""
    threshold = plan.IN_PLACE_ELEMENTS
    path = plain_in_place.main(["--device", "cpu", "--vocab", "512", "--width", "32", "--blocks", "1",
                                "--steps", "eager", "--repeats", "1", "--in-place-elements", "4096",
                                "--out", str(tmp_path)])
    assert plan.IN_PLACE_ELEMENTS == threshold
    record = json.loads(path.read_text())
    assert path == tmp_path / "plain_in_place-cpu.json" and record["torch"] == torch.__version__
    assert record["in_place_elements"] == 4096
    assert [(row["level"], row["step"]) for row in record["rows"]] == [("O2", "eager"), ("O3", "eager")]
    for row in record["rows"]:
        assert row["table_elements"] == 512 * 32 and row["in_place_ms"] > 0 and row["copied_ms"] > 0, row
        assert row["copied_step_bytes"] - row["in_place_step_bytes"] >= 8 * row["table_elements"], row
