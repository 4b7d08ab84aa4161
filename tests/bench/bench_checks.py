"""What the benchmark tests share: the checks of every record (its fields, each variant
timed or skipped for a stated reason), a failing compiler, and a row of counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from conftest import load_bench

COUNTS = load_bench("counting").COUNTS
RECORD_FIELDS = ("benchmark", "device", "torch", "date", "baseline", "fp8", "torchao")


def no_compiler(*args: Any, **kwargs: Any) -> None:
    """A stand-in for ``torch.compile`` that fails as a missing compiler would."""
    raise RuntimeError("compiler unavailable in this test")


def assert_record(path: Path, benchmark: str) -> dict[str, Any]:
    """The record at ``path``, after checking it holds every field of ``RECORD_FIELDS``
    and names ``benchmark``, this torch and torchao's state."""
    record = json.loads(path.read_text())
    missing = [field for field in RECORD_FIELDS if field not in record]
    assert not missing, f"{path.name} lacks {missing}"
    assert record["benchmark"] == benchmark and record["torch"] == torch.__version__
    assert record["torchao"].startswith(("available", "unavailable")), record["torchao"]
    return record


def assert_timed_or_recorded(name: str, variant: dict[str, Any]) -> None:
    """On the CPU every variant runs (or is skipped for a stated reason): an error fails."""
    assert "error" not in variant and ("ms" in variant or "skipped" in variant), f"{name}: {variant}"
    if "ms" in variant:
        assert variant["ms"] > 0 and variant["tflops"] > 0, f"{name}: {variant}"


def counts_row(ops: float = 0, nbytes: float = 0) -> dict[str, float]:
    """A row of ``counting.StepCounter``'s counts: ``ops`` and ``bytes`` as given, every other count 0."""
    return {**dict.fromkeys(COUNTS, 0), "ops": ops, "bytes": nbytes}
