"""The precision report's default view: the summary first, repeated blocks folded into
one row per role with their spread, then only what needs attention.

``report_table`` prints every tensor (``PrecisionReport.print(full=True)``); this view
fits a screen for a model of any depth, and for a model without repeated blocks (or
with two) it shows every row as the full table does.
"""

from __future__ import annotations

from typing import Any

from amp8.config.controller import Move
from amp8.monitor.operand_health import CastTensor, casts_of
from amp8.monitor.report_fold import MIN_FOLD, FoldedRow, fold_names, fold_rows
from amp8.monitor.report_row import ReportRow
from amp8.monitor.report_table import human_bytes, visible_columns
from amp8.monitor.weight_stats import SHORT_DTYPES

TOP = 3
"""Entries per attention line (hot spots, moves, largest tensors)."""

_HIDDEN = {"scale", "scale_min", "layer"}
"""Full-table columns the default view leaves out (per-tensor scales and the layer's
class: ``full=True``)."""

_SPREAD = {"amax", "underflow", "saturated"}
"""Columns that give the spread of their numbers over the blocks."""

_PERCENT = {"underflow", "saturated"}


def _number(key: str, value: float, unit: bool = True) -> str:
    """``value`` of column ``key`` in two digits, as a percent (``unit``: with its sign)
    for shares."""
    if key in _PERCENT:
        return f"{100 * value:.2g}" + ("%" if unit else "")
    return f"{value:.2g}"


def _cell(entry: FoldedRow, key: str) -> str:
    """The display text of one cell of a folded row: the role's shared fields as they
    are, the spread of the numbers over the blocks (the median, and the least and
    largest where they differ)."""
    row = entry.first
    if key == "name":
        return entry.name
    if key == "bytes":
        return f"{entry.bytes / entry.numel:.2f}" if entry.numel else "-"
    if key == "shape":
        return "x".join(map(str, row.shape))
    if key in _SPREAD:
        spread = entry.spread(key)
        if spread is None:
            return "-"
        low, median, high = spread
        if low == high:
            return _number(key, median)
        if key in _PERCENT and median == low:  # most blocks at the least: the range says it
            return f"{_number(key, low, False)}-{_number(key, high)}"
        return f"{_number(key, median)} ({_number(key, low, False)}-{_number(key, high, False)})"
    value = getattr(row, key)
    return "-" if value is None else SHORT_DTYPES.get(value, str(value))


def _worst_block(entry: FoldedRow, key: str) -> str | None:
    """The block of ``entry``'s row with the largest ``key`` (``model.layers.4``), or
    that row's name where ``entry`` folds nothing."""
    name = entry.worst(key)
    if name is None or entry.count == 1:
        return name
    role = entry.name[len(_block_prefix(entry.name)):]
    return name[: len(name) - len(role)].rstrip(".")


def attention_lines(folded: list[FoldedRow], moves: list[Move], table_note: str | None = None,
                    top: int = TOP) -> list[str]:
    """What needs a look, a line each: the roles kept in high precision with the reason,
    the low-bit embedding tables (rows whose note is ``table_note``), the underflow and
    saturation hot spots (the worst block named), the controller's moves (folded over
    blocks), the largest roles by bytes."""
    tables = [entry.name for entry in folded if entry.first.note == table_note]
    kept = [entry for entry in folded if entry.first.note and not entry.first.fp8 and entry.first.note != table_note]
    lines = [f"high precision: {entry.name}: {entry.first.note}" for entry in kept[: 2 * top]]
    if len(kept) > 2 * top:
        lines.append(f"and {len(kept) - 2 * top} more kept in high precision (print(full=True) names each)")
    if tables:
        lines.append(f"FP16 tables with FP8 gradients: {', '.join(tables)}")
    fp8 = [entry for entry in folded if entry.first.fp8]
    for key, label in (("underflow", "underflow"), ("saturated", "saturation")):
        hot = sorted((entry for entry in fp8 if entry.worst(key)), key=lambda entry: -entry.spread(key)[2])  # type: ignore[index]
        if not hot:
            if fp8:
                lines.append(f"{label}: none")
            continue
        shown = []
        for entry in hot[:top]:
            worst = _number(key, entry.spread(key)[2])  # type: ignore[index]
            shown.append(f"{entry.name} up to {worst} ({_worst_block(entry, key)})" if entry.count > 1
                         else f"{entry.name} {worst}")
        more = f" and {len(hot) - top} more" if len(hot) > top else ""
        lines.append(f"{label} hot spots: " + ", ".join(shown) + more)
    lines += _move_lines(moves, top)
    total = sum(entry.bytes for entry in folded)
    if total:
        biggest = sorted(folded, key=lambda entry: -entry.bytes)[:top]
        lines.append("largest: " + ", ".join(
            f"{entry.name} {human_bytes(entry.bytes)} ({100 * entry.bytes / total:.0f}%)" for entry in biggest
        ))
    return lines


def _move_lines(moves: list[Move], top: int) -> list[str]:
    """The controller's moves, those of one step, change and reason folded over blocks."""
    if not moves:
        return []
    kinds = [(move.step, move.before, move.after, move.reason) for move in moves]
    entries = fold_names([move.layer for move in moves], kinds)
    lines = []
    for entry in entries[:top]:
        step, before, after, reason = kinds[entry.members[0]]
        lines.append(f"step {step}: {entry.name} {before} -> {after} ({reason})")
    if len(entries) > top:
        lines.append(f"and {len(entries) - top} more moves (report.moves(), or print(full=True))")
    return lines


def _block_prefix(name: str) -> str:
    """The folded blocks' path of a folded name, through its last index range and the
    dot after it (``model.layers.{0..31}.``), or "" for a name that folds nothing."""
    end = name.rfind("}")
    return name[: end + 2] if end >= 0 and "{" in name else ""


_STORED = ("weight", "grad", "master", "exp_avg", "exp_avg_sq")
_STORED_TITLES = {"weight": "w", "grad": "g", "master": "master", "exp_avg": "m", "exp_avg_sq": "v"}


def _columns(visible: list[tuple[str, str]], granularities: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The default view's columns, from the full table's ``visible`` ones: without the
    per-tensor scales and the layer class, the stored dtypes in one column ("stored"),
    the granularity where the FP8 layers' ``granularities`` differ. Also the row fields
    the "stored" column joins."""
    stored = [key for _, key in visible if key in _STORED]
    shown = []
    for title, key in visible:
        if key == stored[0]:
            shown.append(("/".join(_STORED_TITLES[key] for key in stored), "stored"))
        elif key not in _STORED and key not in _HIDDEN and not (key == "granularity" and len(granularities) < 2):
            shown.append((title, key))
    return shown, stored


def print_folded(folded: list[FoldedRow], moves: list[Move], summary: str, console: Any,
                 table_note: str | None = None) -> None:
    """Print a precision report's rows, ``folded`` (``fold_rows``), on ``console`` as the
    default view (see the module docstring), with the controller's ``moves``, the
    ``summary`` line, and the rows whose note is ``table_note`` named as low-bit
    embedding tables."""
    from rich import box
    from rich.table import Table

    rows = [row for entry in folded for row in entry.rows]
    granularities = {row.granularity for row in rows if row.granularity is not None}
    columns, stored = _columns(visible_columns(rows, moves), granularities)
    line = f"amp8 precision report: {summary}"
    if len(granularities) == 1:
        line += f" FP8 GEMMs: {next(iter(granularities))}."
    console.print(line, highlight=False, markup=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for title, key in columns:
        numeric = key in _SPREAD or key == "bytes"
        table.add_column(title, justify="right" if numeric else "left", overflow="fold", no_wrap=True)
    section = ""
    for entry in folded:
        prefix = _block_prefix(entry.name)
        if prefix and prefix != section:  # the blocks' path once, their roles below it
            table.add_row(f"{prefix[:-1]} x{entry.count}", *[""] * (len(columns) - 1), style="bold")
        section = prefix
        cells = []
        for _, key in columns:
            if key == "name":
                cells.append(f"  {entry.name[len(prefix):]}" if prefix else entry.name)
            elif key == "stored":
                cells.append("/".join(_cell(entry, part) for part in stored))
            else:
                cells.append(_cell(entry, key))
        table.add_row(*cells)
    console.print(table)
    for text in attention_lines(folded, moves, table_note):
        console.print(f"  {text}", highlight=False, markup=False)
    if len(folded) < len(rows):
        console.print("  every tensor: print(full=True), amp8 report --full", highlight=False, markup=False)


_TITLES = dict(zip(CastTensor, ("input", "weight", "grad", "wgrad")))
"""Each tensor's column title in the operands table."""


def _operand_cells(entry: FoldedRow, tensor: CastTensor) -> tuple[str, str]:
    """(worst SQNR in dB, the largest shares flushed to zero and clipped, in percent) of
    the casts of ``tensor`` over ``entry``'s layers and the GEMM operands it feeds."""
    signals = [values for row in entry.rows for values in casts_of(row.operands, tensor)]
    if not signals:
        return "-", "-"
    sqnr = min(values["sqnr_db"] for values in signals)
    flushed = max(values["underflow"] for values in signals)
    clipped = max(values["saturated"] for values in signals)
    return f"{sqnr:.1f}", f"{100 * flushed:.2g} / {100 * clipped:.2g}"


def print_operands(rows: list[ReportRow], console: Any, fold: bool = True) -> None:
    """Print the GEMM operands' health of the FP8 layers that were watched (rows with
    ``operands``), a row per layer role with repeated blocks folded (``fold``) or per
    layer: for the input, the weight, the output gradient and the FP8 weight gradient, the
    worst SQNR of their casts and the largest shares flushed to zero and clipped;
    nothing where no layer was watched."""
    from rich import box
    from rich.table import Table

    watched = [row for row in rows if row.operands]
    if not watched:
        return
    table = Table(title="GEMM operands, last watched: worst SQNR (dB), largest % flushed / clipped",
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, title_justify="left")
    table.add_column("layer", no_wrap=True)
    for title in _TITLES.values():
        table.add_column(f"{title} dB", justify="right", no_wrap=True)
        table.add_column(f"{title} %", justify="right", no_wrap=True)
    for entry in fold_rows(watched, min_fold=MIN_FOLD if fold else len(watched) + 1):
        name = entry.name.removesuffix(".weight")
        table.add_row(name, *(cell for tensor in CastTensor for cell in _operand_cells(entry, tensor)))
    console.print(table)
