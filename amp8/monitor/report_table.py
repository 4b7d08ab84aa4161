"""The precision report as a rich table: which columns show, and each cell's text."""

from __future__ import annotations

from typing import Any

from amp8.config.controller import Move
from amp8.monitor.report_row import ReportRow
from amp8.monitor.weight_stats import SHORT_DTYPES

def human_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _cell(row: ReportRow, key: str) -> str:
    """The display text of the cell of ``row``'s field ``key``."""
    value = getattr(row, key)
    if key == "bytes":
        return f"{value / row.numel:.2f}"
    if key == "shape":
        return "x".join(map(str, value))
    if value is None:
        return "-"
    if key in ("underflow", "saturated"):
        return f"{100 * value:.2g}%"
    if key in ("scale", "amax"):
        return f"{value:.3g}"
    if key == "scale_min":
        return f"{value:.3g}..{row.scale_max:.3g}"
    return SHORT_DTYPES.get(value, str(value))


_COLUMNS = (
    ("parameter", "name"), ("shape", "shape"), ("layer", "layer"), ("weight", "weight"),
    ("grad", "grad"), ("master", "master"), ("m", "exp_avg"), ("v", "exp_avg_sq"),
    ("granularity", "granularity"), ("GEMMs", "gemms"), ("format", "format"), ("block", "block"),
    ("scale", "scale"), ("scale range", "scale_min"),
    ("amax", "amax"), ("underflow", "underflow"),
    ("saturated", "saturated"), ("B/param", "bytes"),
)
_ALWAYS_SHOWN = {"name", "shape", "layer", "weight", "grad", "bytes"}
_NUMERIC = {"scale", "scale_min", "amax", "underflow", "saturated", "bytes"}

def visible_columns(rows: list[ReportRow], moves: list[Move]) -> list[tuple[str, str]]:
    """The (title, row field) of each column worth showing for ``rows``: a column where some
    row has a value (no "master" before O3), the scale range where some tensor has scales
    finer than per tensor, the GEMMs' precision where some layer's differs from its
    recipe (or the controller ``moves`` made)."""
    columns = [(title, key) for title, key in _COLUMNS
               if key in _ALWAYS_SHOWN or any(getattr(row, key) is not None for row in rows)]
    if all(row.granularity in (None, "tensorwise") for row in rows):
        columns = [(title, key) for title, key in columns if key != "scale_min"]
    if not moves and all(row.gemms in (None, row.granularity) for row in rows):
        columns = [(title, key) for title, key in columns if key != "gemms"]
    return columns


def print_table(rows: list[ReportRow], moves: list[Move], summary: str, highlights: list[str], console: Any) -> None:
    """Print a precision report's ``rows`` (``PrecisionReport.rows``) on ``console`` as a
    rich table, one row per tensor, with notes, the controller's ``moves``, the
    ``summary`` line and the ``highlights`` below it."""
    from rich.table import Table

    columns = visible_columns(rows, moves)
    table = Table(title="amp8 precision report")
    for title, key in columns:
        # Names and headers fold onto more lines rather than being cut short.
        table.add_column(title, justify="right" if key in _NUMERIC else "left", overflow="fold")
    notes: list[str] = []
    for row in rows:
        cells = {key: _cell(row, key) for _, key in columns}
        if row.note:
            notes.append(f"{row.name}: {row.note}")
            cells["layer"] += f" [{len(notes)}]"
        table.add_row(*cells.values())
    console.print(table)
    for index, note in enumerate(notes, start=1):
        console.print(f"[{index}] {note}", highlight=False, markup=False)
    for move in moves:
        console.print(
            f"step {move.step}: {move.layer} {move.before} -> {move.after} ({move.reason})",
            highlight=False, markup=False,
        )
    console.print(summary, highlight=False)
    for line in highlights:
        console.print(f"  {line}", highlight=False, markup=False)
