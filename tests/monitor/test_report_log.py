"""The precision report over a run: ReportLog, read_log and ``amp8 report --run FILE.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import amp8
from amp8.monitor.report_log import drift_lines, read_log
from amp8.tools.cli import main


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1", recipe=amp8.Recipe())


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[bool]:
    """Train ``steps`` steps; whether each step's casts were watched."""
    watched = []
    for _ in range(steps):
        watched.append(model[0].watch_health)
        model(torch.randn(16, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return watched


@pytest.mark.parametrize("every", [1, 3])
def test_a_record_every_n_steps_with_that_steps_operands_watched(tmp_path: Path, every: int) -> None:
    model, optimizer = _model()
    seen: list[dict] = []
    log = amp8.ReportLog(model, optimizer, tmp_path / "run" / "report.jsonl", every=every, on_record=seen.append)
    watched = _train(model, optimizer, 7)
    assert watched == [(step + 1) % every == 0 for step in range(7)], "only the step before a record is watched"
    assert [entry["step"] for entry in log.records] == list(range(every, 8, every))
    assert seen == log.records == read_log(tmp_path / "run" / "report.jsonl")
    layer = log.records[-1]["layers"]["0.weight"]
    assert {"amax", "underflow", "saturated", "gemms"} <= set(layer)
    assert float(layer["operands"]["fprop input"]["sqnr_db"]) > 20
    json.dumps(log.records)  # plain data, as a logger takes it
    log.remove()
    _train(model, optimizer, 3)
    assert len(log.records) == 7 // every and not model[0].watch_health


def test_amp8_report_run_prints_the_drift_of_a_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, optimizer = _model()
    path = tmp_path / "report.jsonl"
    log = amp8.ReportLog(model, optimizer, path, every=2)
    _train(model, optimizer, 4)
    assert main(["report", "--run", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == drift_lines(log.records)
    assert out.startswith("step 2: ") and "step 4: " in out and "worst operand SQNR" in out


def test_a_bad_interval_and_a_bad_log_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, optimizer = _model()
    with pytest.raises(ValueError, match="every=0"):
        amp8.ReportLog(model, optimizer, every=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1 is not a ReportLog record"):
        read_log(bad)
    assert main(["report", "--run", str(bad)]) == 2
    assert main(["report", "--run", str(tmp_path / "none.jsonl")]) == 2


@pytest.mark.parametrize(("content", "problem"), [
    (None, "does not exist"),
    ("", "holds no record"),
    ("\n  \n", "holds no record"),
])
def test_an_empty_or_missing_log_names_the_file_and_what_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str | None, problem: str
) -> None:
    path = tmp_path / "empty.jsonl"
    if content is not None:
        path.write_text(content)
    writes_it = r"amp8\.ReportLog\(model, optimizer, \"[^\"]*empty\.jsonl\", every=N\) appends one record every N"
    with pytest.raises((ValueError, FileNotFoundError), match=f"empty.jsonl {problem}: {writes_it}"):
        read_log(path)
    assert main(["report", "--run", str(path)]) == 2, "no record is an error, not an empty drift"
    out = capsys.readouterr().out
    assert out.startswith(f"amp8 report: {path} {problem}: amp8.ReportLog(") and out.count("\n") == 1, out
    assert "train at least N steps with the log attached" in out, out


def test_a_folder_is_not_a_log(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "run.jsonl").mkdir()
    assert main(["report", "--run", str(tmp_path / "run.jsonl")]) == 2
    assert "run.jsonl is a folder, not a ReportLog file" in capsys.readouterr().out
