"""Which opt level a comparison recommends, and why (``CompareResult.recommended``).

The rule: among the opt levels that trained from every seed, those whose gap to O0 is
within the threshold (``threshold_percent``, 0.5 % of O0's final loss by default) or,
with several seeds, within the noise floor (the null variant's gap plus two standard
errors of the level's paired gap) qualify; of those, the one that stores the fewest bytes
per parameter is recommended (the lower level on a tie, O0 first). When no FP8 level
qualifies the answer is O0, with what kept each level out: the run's failure, or its gap
and the tensors its precision report shows in trouble (underflow, saturation).

It summarises one measurement (these steps, these seeds), not a promise about a longer
run; the text says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from amp8.config.levels import LEVELS
from amp8.tools.experiments.paired import PairedResult
from amp8.tools.experiments.train import RunResult

BASELINE = "O0"
NULL = "O0-null"
TROUBLE_SHARE = 0.01
"""A weight with more than this share of its elements flushed (underflow) or clipped
(saturated) by its FP8 cast counts as in trouble."""
CAVEAT = ("This summarises one measurement, not a promise: confirm the level on your full run "
          "(more steps and seeds can move small gaps)")


class Measured(Protocol):
    """What the recommendation reads of a comparison (``CompareResult`` is one)."""

    config: Any  # its ``levels`` and ``steps``

    @property
    def seeds(self) -> tuple[int, ...]: ...

    def runs_of(self, name: str) -> Sequence[RunResult]: ...

    def paired(self) -> PairedResult | None: ...

    def gap_percent(self, name: str, seed: int | None = None) -> float | None: ...


@dataclass(frozen=True)
class Recommendation:
    """The level a comparison recommends and why.

    Attributes:
        level: the opt level to use ("O0" when no FP8 level qualifies), or None when O0
            itself did not train (nothing to measure against).
        reason: why, in a sentence or two, ending with the caveat that it summarises a
            measurement.
        threshold_percent: the gap to O0 (percent) a level had to stay within.
        qualified: the levels that qualified, O0 included, in the table's order.
        gaps_percent: each FP8 level's gap to O0 that was judged (mean over seeds).
    """

    level: str | None
    reason: str
    threshold_percent: float
    qualified: tuple[str, ...] = ()
    gaps_percent: dict[str, float] | None = None

    def __str__(self) -> str:
        """The line printed under the table: "recommended: O2: <reason>"."""
        return f"recommended: {self.level or 'none'}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for JSON."""
        return {"level": self.level, "reason": self.reason, "threshold_percent": self.threshold_percent,
                "qualified": list(self.qualified), "gaps_percent": self.gaps_percent}


def trouble_tensors(report: dict[str, Any] | None, top: int = 3) -> list[str]:
    """The weights of a run's precision report (``report.to_dict()``) whose FP8 cast
    flushes or clips more than ``TROUBLE_SHARE`` of their elements, worst first, as
    "name underflow 12%" (at most ``top``)."""
    if not report:
        return []
    found = []
    for row in report.get("rows", []):
        for key, label in (("underflow", "underflow"), ("saturated", "saturation")):
            share = row.get(key)
            if row.get("fp8") and share is not None and share > TROUBLE_SHARE:
                found.append((share, f"{row['name']} {label} {100 * share:.2g}%"))
    return [text for _, text in sorted(found, key=lambda item: -item[0])[:top]]


def _level_gap(result: Measured, name: str) -> tuple[float, float | None] | None:
    """The gap to O0 of level ``name`` (mean over seeds, percent) and its standard error
    (None with one seed); None unless it trained from every seed with a finite loss."""
    paired = result.paired()
    if paired is not None:
        if name not in paired.losses:
            return None
        gap = paired.mean_gap_percent(name)
        return (gap, paired.stderr_percent(name)) if math.isfinite(gap) else None
    runs = result.runs_of(name)
    if not runs or not runs[0].ok:
        return None
    gap = result.gap_percent(name)
    return (gap, None) if gap is not None and math.isfinite(gap) else None


def _noise_bound(result: Measured, stderr: float | None) -> float | None:
    """With several seeds: the null variant's |gap| plus two standard errors of the
    level's gap, the largest gap that drift alone explains; None with one seed."""
    paired = result.paired()
    if paired is None or stderr is None:
        return None
    null = abs(paired.mean_gap_percent(NULL)) if NULL in paired.losses else 0.0
    return null + 2 * stderr


def recommend(result: Measured, threshold_percent: float) -> Recommendation:
    """The recommendation for ``result`` at ``threshold_percent`` (see the module
    docstring)."""
    seeds = len(result.seeds)
    measured = f"{result.config.steps} steps, {seeds} seed{'s' if seeds > 1 else ''}"
    caveat = f"{CAVEAT}; measured over {measured}."
    base = result.runs_of(BASELINE)
    if not base or not all(run.ok for run in base):
        why = next((run.reason for run in base if not run.ok), None) or "it did not run"
        return Recommendation(None, f"O0 did not train ({why}); there is nothing to measure FP8 against. "
                                    f"Fix the model, data or loss first. {caveat}", threshold_percent)
    levels = [name for name in LEVELS if name in result.config.levels and name != BASELINE]
    qualified = [BASELINE]
    gaps: dict[str, float] = {}
    out: list[str] = []
    bytes_of = {BASELINE: base[0].bytes_per_param}
    for name in levels:
        runs = result.runs_of(name)
        failed = next((run for run in runs if not run.ok), None)
        if not runs:
            continue
        if failed is not None:
            out.append(f"{name} {failed.status} ({_short(failed.reason)})")
            continue
        measured_gap = _level_gap(result, name)
        if measured_gap is None:
            out.append(f"{name} ended with a loss that is not finite")
            continue
        gap, stderr = measured_gap
        gaps[name] = gap
        bytes_of[name] = runs[0].bytes_per_param
        noise = _noise_bound(result, stderr)
        if gap <= threshold_percent or (noise is not None and gap <= noise):
            qualified.append(name)
            continue
        trouble = trouble_tensors(runs[0].report)
        seen = ("its report shows " + ", ".join(trouble)) if trouble else \
            "its report shows no weight flushed or clipped beyond 1%"
        floor = "" if noise is None else f" and the noise floor {noise:.2f}%"
        out.append(f"{name} ended {_signed(gap)}% from O0, over the {threshold_percent:g}% threshold{floor}; {seen}")
    order = {name: index for index, name in enumerate(LEVELS)}
    best = min(qualified, key=lambda name: (bytes_of.get(name) or math.inf, order[name]))
    if best == BASELINE:
        if not levels:
            why = "no FP8 level was trained (levels holds only O0)"
        elif not out:
            why = "no FP8 level stores fewer bytes per parameter than O0 on this model (no layer ran in FP8?)"
        else:
            why = "no FP8 level qualified: " + "; ".join(out)
        return Recommendation(BASELINE, f"{why}. {caveat}", threshold_percent, tuple(qualified), gaps)
    saving = ""
    if bytes_of.get(BASELINE) and bytes_of.get(best):
        saving = (f" and stores {bytes_of[best]:.2f} bytes/param against O0's {bytes_of[BASELINE]:.2f} "
                  f"({bytes_of[BASELINE] / bytes_of[best]:.2f}x less)")
    within = f"within the {threshold_percent:g}% threshold"
    noise = _noise_bound(result, _level_gap(result, best)[1])  # type: ignore[index]
    if gaps[best] > threshold_percent and noise is not None:
        within = f"within the noise floor ({noise:.2f}%)"
    others = [name for name in qualified if name not in (BASELINE, best)]
    also = f"; {', '.join(others)} also qualified but store more" if others else ""
    rest = f"; {'; '.join(out)}" if out else ""
    return Recommendation(
        best, f"it ends {_signed(gaps[best])}% from O0, {within},{saving}{also}{rest}. {caveat}",
        threshold_percent, tuple(qualified), gaps,
    )


def _short(reason: str | None, limit: int = 160) -> str:
    """``reason`` on one line, cut to ``limit`` characters."""
    text = " ".join((reason or "no reason given").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _signed(percent: float) -> str:
    """``percent`` to two decimals with its sign."""
    return f"{round(percent, 2) + 0.0:+.2f}"

