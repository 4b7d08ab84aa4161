"""The precision report over a run: its summary and each FP8 layer's health every N
optimizer steps, as plain dicts and as lines of a JSON-lines file.

``ReportLog(model, optimizer, "report.jsonl", every=100)`` hooks the optimizer's step.
The step before each record runs with every FP8 layer's operands watched
(``watch_operands``), so the record holds their casts' health too; the other steps run
as they would without it. ``amp8 report --run report.jsonl`` prints the drift.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from amp8.monitor.operand_health import watch_operands
from amp8.monitor.report import report

DEFAULT_EVERY = 100
"""Optimizer steps between records."""


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan"), so the line is JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    return value


def report_record(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> dict[str, Any]:
    """One record of the log: the report's totals at ``step`` and, per FP8 layer's
    weight, its amax, underflow, saturation, how its GEMMs run, and its operands' health
    where they were watched."""
    precision = report(model, optimizer)
    layers = {
        row.name: {"amax": row.amax, "underflow": row.underflow, "saturated": row.saturated, "gemms": row.gemms}
        | ({"operands": row.operands} if row.operands else {})
        for row in precision.rows if row.fp8 and row.amax is not None
    }
    return _finite({
        "step": step,
        "bytes_per_param": precision.bytes_per_param,
        "fp8_share": precision.fp8_share,
        "skipped_steps": precision.skipped_steps,
        "moves": len(precision.moves()),
        "layers": layers,
    })


class ReportLog:
    """Record ``report_record`` every ``every`` optimizer steps (see the module docstring).

    Args:
        model: the model ``amp8.initialize`` returned.
        optimizer: its optimizer; the log hooks its ``step`` (``remove()`` unhooks it).
        path: the JSON-lines file each record is appended to, or None to keep them in
            ``records`` only.
        every: optimizer steps between records (the first after step ``every``).
        on_record: called with each record (a plain dict: hand it to TensorBoard, or
            another logger).

    Raises:
        ValueError: ``every`` is not an int >= 1.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path | None = None,
                 every: int = DEFAULT_EVERY, on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ReportLog(every={every!r}) is not valid; use an int >= 1 (optimizer steps)")
        self.model, self.optimizer, self.every, self.on_record = model, optimizer, every, on_record
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        self.steps = 0
        self._watch: Any = None  # the open watch_operands block, during the step before a record
        self._handle = optimizer.register_step_post_hook(self._after_step)
        if every == 1:
            self._open_watch()

    def _open_watch(self) -> None:
        self._watch = watch_operands(self.model)
        self._watch.__enter__()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            if self._watch is not None:
                self._watch.__exit__(None, None, None)
                self._watch = None
            self.record()
        if (self.steps + 1) % self.every == 0:  # the next step is recorded: watch its casts
            self._open_watch()

    def record(self) -> dict[str, Any]:
        """Record now (as the hook does every ``every`` steps): append to ``records`` and
        the file, call ``on_record``; returns the record."""
        entry = report_record(self.model, self.optimizer, self.steps)
        self.records.append(entry)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps(entry) + "\n")
        if self.on_record is not None:
            self.on_record(entry)
        return entry

    def remove(self) -> None:
        """Unhook the optimizer's step (a watch left open is closed)."""
        self._handle.remove()
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``ReportLog`` file, at least one.

    Raises:
        FileNotFoundError: no file at ``path`` (a ``ReportLog`` writes its file at its
            first record, ``every`` steps in), naming it and what to do.
        ValueError: ``path`` is a folder, holds no record, or has a line that is not a
            record, naming it and what to do.
    """
    path = Path(path)
    how = (f"amp8.ReportLog(model, optimizer, \"{path}\", every=N) appends one record every N optimizer steps "
           f"(N={DEFAULT_EVERY} by default), the first after step N")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: {how}; train at least N steps with the log attached, "
                                "or pass the path it was given")
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a ReportLog file: pass the .jsonl file ReportLog wrote")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            entry["step"], entry["layers"]  # noqa: B018 (a record has both)
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number} is not a ReportLog record") from None
        records.append(entry)
    if not records:
        raise ValueError(f"{path} holds no record: {how}, and never writes an empty file; train at least N "
                         "steps with the log attached, or pass the file it wrote")
    return records


def drift_lines(records: list[dict[str, Any]]) -> list[str]:
    """A line per record: step, bytes/param, FP8 share, the controller's moves so far,
    the largest underflow and saturation over the FP8 weights (and where), and the
    worst operand SQNR where operands were watched."""
    lines = []
    for entry in records:
        layers = entry["layers"]
        text = (f"step {entry['step']}: {entry['bytes_per_param']:.2f} B/param, "
                f"{100 * entry['fp8_share']:.1f}% FP8, {entry['moves']} moves")
        for key in ("underflow", "saturated"):
            worst = max(layers, key=lambda name: layers[name][key] or 0, default=None)
            if worst is not None and layers[worst][key]:
                text += f"; {key} {100 * layers[worst][key]:.2g}% ({worst})"
        sqnrs = [(float(values["sqnr_db"]), f"{name} {label}") for name, layer in layers.items()
                 for label, values in (layer.get("operands") or {}).items()]
        if sqnrs:
            sqnr, where = min(sqnrs)
            text += f"; worst operand SQNR {sqnr:.1f} dB ({where})"
        lines.append(text)
    return lines
