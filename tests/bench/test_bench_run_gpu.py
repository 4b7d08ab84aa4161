"""bench/run_gpu.sh: its CPU check runs every Python step; bad arguments are refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT


@pytest.mark.slow  # every Python step of the GPU script, at tiny sizes on the CPU
def test_run_gpu_cpu_check_runs_every_python_step(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--cpu-check", "--quick", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run_gpu.log").read_text()
    for step in ("optimizer", "gpt", "llama", "linear", "kernels", "plain", "sweep"):
        assert re.search(rf"^== {step}: \d+ s, ok$", log, re.MULTILINE), f"{step} did not pass:\n{log[-2000:]}"
    assert "== cuda-tests: skipped" in log and "== static-shapes: skipped (--quick: it compiles)" in log
    written = {path.name for path in tmp_path.glob("*.json")}
    assert written == {"optimizer-cpu.json", "gpt-cpu.json", "gpt-llama-tiny-cpu.json", "linear-cpu.json",
                       "optimizer_kernels-cpu.json", "linear-sweep-cpu.json", "plain_in_place-cpu.json"}, written
    llama = json.loads((tmp_path / "gpt-llama-tiny-cpu.json").read_text())
    assert llama["runs"]["amp8 O2"]["eager"]["optimizer_ms"] > 0


def test_run_gpu_runs_only_the_steps_asked_for(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--cpu-check", "--quick", "--steps", "linear",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run_gpu.log").read_text()
    assert re.search(r"^== linear: \d+ s, ok$", log, re.MULTILINE), log[-2000:]
    for step in ("optimizer", "kernels", "static-shapes", "gpt", "cuda-tests", "llama", "plain", "sweep"):
        assert f"== {step}: not asked for (--steps linear)" in log, log[-2000:]
    assert {path.name for path in tmp_path.glob("*.json")} == {"linear-cpu.json"}


@pytest.mark.parametrize("arguments, message", [
    (["--budget", "soon"], "--budget takes whole seconds"), (["--quick"], "--quick goes with --cpu-check"),
    (["--fast"], "unknown option --fast"), (["--steps", "gpt;ls"], "--steps takes step names"),
])
def test_run_gpu_refuses_bad_arguments(tmp_path: Path, arguments: list[str], message: str) -> None:
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), *arguments, str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 64 and message in done.stderr, (done.returncode, done.stderr)


class _Terminal:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write_line(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize("outcome", ["passed", "failed", "skipped"])
def test_the_cuda_tests_print_a_failure_as_it_happens(outcome: str) -> None:
    """run_gpu.sh's CUDA tests run with ``AMP8_SHOW_FAILURES_AT_ONCE=1``: a failure's
    traceback is printed when its test ends, not at the end of a run that its time limit
    may cut off."""
    from types import SimpleNamespace

    from conftest import FailuresAtOnce

    terminal = _Terminal()
    report = SimpleNamespace(failed=outcome == "failed", nodeid="tests/test_cuda.py::test_x", when="call",
                             longreprtext="AssertionError: one is not two")
    FailuresAtOnce(terminal).pytest_runtest_logreport(report)  # type: ignore[arg-type]
    if outcome == "failed":
        assert len(terminal.lines) == 1 and "FAILED tests/test_cuda.py::test_x (call)" in terminal.lines[0]
        assert "one is not two" in terminal.lines[0]
    else:
        assert terminal.lines == []
    assert "AMP8_SHOW_FAILURES_AT_ONCE=1" in (ROOT / "bench" / "run_gpu.sh").read_text()
