"""Repeated blocks of a model folded into one entry per role.

A transformer's 32 blocks hold the same tensors under names that differ only in the
block's index (``model.layers.7.mlp.down_proj.weight``). ``fold_names`` groups names that
differ only in their numeric path components and names each group by its pattern, with
the indices it spans (``model.layers.{0..31}.mlp.down_proj.weight``); ``fold_rows`` does
the same for a precision report's rows, keeping apart the rows whose stored dtypes,
shapes or GEMMs differ (a layer the controller moved stays visible as its own group).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

from amp8.monitor.report_row import ReportRow

MIN_FOLD = 3
"""The fewest names that fold into one entry: two blocks stay two rows, as they read best."""

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
"""A numeric component of a dotted path (``layers.7.mlp``: the ``7``)."""

SAME_ROLE_KEYS = (
    "shape", "layer", "fp8", "note", "weight", "grad", "frozen", "master", "exp_avg", "exp_avg_sq",
    "granularity", "gemms", "format", "block",
)
"""``ReportRow`` fields that must agree for rows to fold together: what is stored and how
the layer's GEMMs run. The numbers (scales, amax, underflow, saturation, bytes) may
differ; a folded entry gives their spread."""


def pattern_of(name: str) -> tuple[str, tuple[int, ...]]:
    """``name`` with each numeric path component replaced by ``{}``, and those numbers."""
    return _INDEX.sub("{}", name), tuple(int(match.group()) for match in _INDEX.finditer(name))


def _ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0..3,5"``: sorted distinct values, runs of three or more
    as ``first..last``."""
    ordered = sorted(set(values))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}..{ordered[end]}")
        else:
            parts.extend(str(value) for value in ordered[start:end + 1])
        start = end + 1
    return ",".join(parts)


def folded_name(pattern: str, indices: list[tuple[int, ...]]) -> str:
    """The name of a group: ``pattern`` with each ``{}`` filled by the one number the
    group's names share there, or ``{first..last}`` (``{0,2,5}``) where they differ."""
    parts = pattern.split("{}")
    filled = [parts[0]]
    for position, tail in enumerate(parts[1:]):
        values = {index[position] for index in indices}
        text = str(next(iter(values))) if len(values) == 1 else "{" + _ranges(values) + "}"
        filled += [text, tail]
    return "".join(filled)


@dataclass(frozen=True)
class Folded:
    """One entry of a folded list: its name, and the positions (in the input) it holds."""

    name: str
    members: tuple[int, ...]

    @property
    def count(self) -> int:
        """How many it folds."""
        return len(self.members)


def fold_names(names: list[str], keys: list[Any] | None = None, min_fold: int = MIN_FOLD) -> list[Folded]:
    """``names`` folded by their pattern (see ``pattern_of``), and by ``keys`` where given
    (names fold only where their keys are equal too), in the order each group first
    appears. A group of fewer than ``min_fold`` names stays one entry per name."""
    patterns = [pattern_of(name) for name in names]
    groups: dict[tuple[str, Any], list[int]] = {}
    for position, (pattern, _) in enumerate(patterns):
        groups.setdefault((pattern, None if keys is None else keys[position]), []).append(position)
    entries = []
    for (pattern, _), members in groups.items():
        if len(members) < min_fold:
            entries += [Folded(names[position], (position,)) for position in members]
        else:
            indices = [patterns[position][1] for position in members]
            entries.append(Folded(folded_name(pattern, indices), tuple(members)))
    return sorted(entries, key=lambda entry: entry.members[0])


@dataclass(frozen=True)
class FoldedRow:
    """Report rows of one role over repeated blocks (or one row alone)."""

    name: str
    rows: tuple[ReportRow, ...]

    @property
    def count(self) -> int:
        """How many rows it folds."""
        return len(self.rows)

    @property
    def first(self) -> ReportRow:
        """The first row it folds (the fields in ``SAME_ROLE_KEYS`` are the same in all)."""
        return self.rows[0]

    def values(self, key: str) -> list[float]:
        """The rows' values of the field ``key`` that are not None, in row order."""
        return [value for value in (getattr(row, key) for row in self.rows) if value is not None]

    def spread(self, key: str) -> tuple[float, float, float] | None:
        """(min, median, max) of ``key`` over the rows, or None where no row has one."""
        values = self.values(key)
        return (min(values), statistics.median(values), max(values)) if values else None

    def worst(self, key: str) -> str | None:
        """The name of the row with the largest ``key`` (the first, on a tie), or None
        where no row has a value above zero."""
        rows = [row for row in self.rows if (getattr(row, key) or 0) > 0]
        return max(rows, key=lambda row: getattr(row, key)).name if rows else None

    @property
    def numel(self) -> int:
        """Parameters over the rows."""
        return sum(row.numel for row in self.rows)

    @property
    def bytes(self) -> int:
        """Bytes over the rows."""
        return sum(row.bytes for row in self.rows)


def _role_key(row: ReportRow) -> tuple[Any, ...]:
    return tuple(repr(getattr(row, key)) for key in SAME_ROLE_KEYS)


def fold_rows(rows: list[ReportRow], min_fold: int = MIN_FOLD) -> list[FoldedRow]:
    """A precision report's ``rows`` folded over repeated blocks (see the module
    docstring), in the order each group first appears."""
    entries = fold_names([row.name for row in rows], [_role_key(row) for row in rows], min_fold)
    return [FoldedRow(entry.name, tuple(rows[position] for position in entry.members)) for entry in entries]
