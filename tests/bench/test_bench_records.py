"""bench/records.py: a result record replaces its file whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import load_bench

records = load_bench("records")


def test_write_result_replaces_the_file_whole(tmp_path: Path) -> None:
    device = torch.device("cpu")
    records.write_result("probe", device, {"rows": [1]}, tmp_path)
    path = records.write_result("probe", device, {"rows": [1, 2]}, tmp_path)
    assert json.loads(path.read_text())["rows"] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe-cpu.json"], "no partial file is left"


def test_command_line_holds_the_arguments_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bench run from the shell (``main()`` without arguments) records the process's
    arguments; one called with ``argv`` records those."""
    monkeypatch.setattr("sys.argv", ["bench/optimizer_host.py", "--layers", "1000"])
    assert records.command_line("optimizer_host.py", None) == "python bench/optimizer_host.py --layers 1000"
    assert records.command_line("optimizer_host.py", ["--repeats", "3"]) == "python bench/optimizer_host.py --repeats 3"
    assert records.command_line("optimizer_host.py", []) == "python bench/optimizer_host.py"
