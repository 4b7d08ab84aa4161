"""bench/linear.py runs every variant on the CPU with tiny settings and writes complete JSON;
the FP8 threshold rule reads the right K and N off a grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import amp8
from bench_checks import assert_record, assert_timed_or_recorded, no_compiler
from conftest import load_bench

linear = load_bench("linear")


@pytest.mark.compile
@pytest.mark.integration  # torchao's float8 where it is installed
def test_linear_quick_writes_every_variant(tmp_path: Path) -> None:
    path = linear.main(["--quick", "--device", "cpu", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)])
    record = assert_record(path, "linear")
    assert path == tmp_path / "linear-cpu.json"
    assert record["baseline"] == "nn.Linear FP32" and record["fp8"] == "emulated on the CPU"
    assert [(r["m"], r["k"], r["n"]) for r in record["rows"]] == [(1024, 2048, 1024)]
    for row in record["rows"]:
        for name, variant in row["variants"].items():
            assert_timed_or_recorded(name, variant)
        assert row["variants"]["nn.Linear"]["ms"] > 0 and row["variants"]["Fp8Linear"]["ms"] > 0
        assert row["baseline_ms"] > 0 and row["speedup"]["Fp8Linear"] > 0
        assert set(row["speedup"]) == set(linear.CANDIDATES)


def test_linear_records_a_failed_compile_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", no_compiler)
    row = linear.run_shape((32, 64, 32), torch.device("cpu"), None, warmup=0, repeats=1, compile=True)
    assert "compiler unavailable" in row["variants"]["Fp8Linear compiled"]["error"]
    assert row["variants"]["Fp8Linear"]["ms"] > 0
    assert row["speedup"]["Fp8Linear compiled"] is None and row["speedup"]["Fp8Linear"] > 0
    assert row["variants"]["torchao compiled"] == {"skipped": "torchao unavailable"}


def test_linear_sweep_reports_speedups_per_cell() -> None:
    grid = (32, 64)
    shapes = linear.shapes_to_run(True, 48, grid, quick=False)
    assert shapes[: len(linear.SWEEP)] == linear.SWEEP
    assert shapes[len(linear.SWEEP):] == [(48, 32, 32), (48, 32, 64), (48, 64, 32), (48, 64, 64)]
    rows = [linear.run_shape(s, torch.device("cpu"), None, 0, 1, compile=False) for s in shapes[len(linear.SWEEP):]]
    selection = linear.layer_selection(rows, 48, grid, "CPU")
    assert [(c["k"], c["n"]) for c in selection["cells"]] == [(32, 32), (32, 64), (64, 32), (64, 64)]
    assert all(c["speedup_eager"] > 0 and c["speedup_compiled"] is None for c in selection["cells"])
    assert selection["speed_rule_compiled"] is None
    rule = amp8.nn.selection.SpeedRule.from_json(json.dumps({"speed_rule": selection["speed_rule"]}))
    assert rule == amp8.nn.selection.SpeedRule(**selection["speed_rule_eager"])
    for cell in selection["cells"]:  # the rule takes no cell that was slower
        if rule.selects(cell["k"], cell["n"]):
            assert cell["speedup_eager"] >= 1.0, cell


def test_quick_skips_large_shapes() -> None:
    shapes = linear.shapes_to_run(False, 4096, (1024,), quick=True)
    assert shapes and all(6 * m * k * n <= linear.QUICK_FLOP_LIMIT for m, k, n in shapes)
    assert linear.shapes_to_run(False, 4096, (1024,), quick=False) == linear.HEADLINE


@pytest.mark.parametrize("sweep", [False, True])
def test_linear_listed_shapes_replace_the_default_ones(sweep: bool) -> None:
    listed = linear.parse_args(["--shapes", "64,128,64", "32,32,32"]).shapes
    assert listed == [(64, 128, 64), (32, 32, 32)]
    grid = [(16, 8, 8)] if sweep else []
    assert linear.shapes_to_run(sweep, 16, (8,), quick=False, listed=listed) == listed + grid


@pytest.mark.parametrize("text", ["64,128", "64,0,64", "a,b,c"])
def test_linear_refuses_a_bad_shape(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        linear.parse_args(["--shapes", text])
    assert f"shape {text!r}" in capsys.readouterr().err
