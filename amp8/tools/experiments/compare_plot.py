"""The PNG of an ``amp8 compare`` call: panels side by side, the train loss, the
validation loss, the opt levels' validation-loss gap to O0 in percent, and the other
runs' gap (the ablations: no scaling, the noise floor, ...) on an axis of their own.

The loss curves of runs that differ by FP8 rounding lie on one another at the scale of
the loss; the gap panels draw what tells them apart. The levels get a panel of their own
because an ablation's gap (tens of percent without scaling) would flatten theirs (tenths
of a percent) onto the zero line. Each curve is the mean over the seeds its run trained
from, each gap taken against O0 from the same seed; with several seeds, a band spans the
seeds' gaps. A comparison of the user's own model without ``eval_data`` draws the train
loss (mean of the last ``train_loss_window`` steps) at each evaluation step in place of
the validation loss.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from amp8.config.levels import LEVELS
from amp8.tools.experiments.compare_result import CompareResult
from amp8.tools.experiments.paired import BASELINE, gaps_percent
from amp8.tools.experiments.train import RunResult


def mean_train_curve(result: CompareResult, name: str, window: int) -> tuple[list[int], list[float]]:
    """The train loss of run ``name``, averaged over its seeds and then over a sliding
    window of ``window`` steps: the steps (0-based, the window's last) and the losses."""
    curves = torch.tensor([r.train_curve for r in result.runs_of(name) if r.ok])  # (seeds, steps)
    curve = curves.mean(dim=0)
    smooth = curve.unfold(0, window, 1).mean(dim=1) if len(curve) >= window else curve
    first = window - 1 if len(curve) >= window else 0
    return list(range(first, first + len(smooth))), smooth.tolist()


def eval_curve(result: CompareResult, run: RunResult) -> list[list[float]]:
    """The ``[step, loss]`` pairs a run's gap curve is drawn from: its validation curve,
    or without validation data the mean train loss of the last ``train_loss_window``
    steps at every ``eval_interval`` steps and at the end."""
    if result.has_validation:
        return run.val_curve
    interval, window, curve = result.config.eval_interval, result.config.train_loss_window, run.train_curve
    steps = [step for step in range(1, len(curve) + 1) if step % interval == 0 or step == len(curve)]
    return [[step, statistics.fmean(curve[max(0, step - window):step])] for step in steps]


def mean_val_curve(result: CompareResult, name: str) -> tuple[list[float], list[float]]:
    """The validation loss of run ``name`` at each evaluation, averaged over its seeds:
    the steps and the losses."""
    curves = [eval_curve(result, r) for r in result.runs_of(name) if r.ok]
    steps = [step for step, _ in curves[0]]
    return steps, [statistics.fmean(curve[i][1] for curve in curves) for i in range(len(steps))]


def seed_gap_curves(result: CompareResult, name: str) -> tuple[list[float], list[list[float]]]:
    """The validation-loss gap of run ``name`` to O0 at each evaluation, in percent, seed
    by seed (each against O0 from the same seed): the steps, and per step the gaps of
    the seeds both runs trained from."""
    pairs = [(run, result.run(BASELINE, run.seed)) for run in result.runs_of(name) if run.ok]
    pairs = [(run, base) for run, base in pairs if base.ok]
    curves = [(eval_curve(result, run), eval_curve(result, base)) for run, base in pairs]
    steps = [step for step, _ in curves[0][0]]
    gaps = []
    for i in range(len(steps)):
        losses = {name: [run[i][1] for run, _ in curves], BASELINE: [base[i][1] for _, base in curves]}
        gaps.append(gaps_percent(losses, name))
    return steps, gaps


def gap_curve(result: CompareResult, name: str) -> tuple[list[float], list[float]]:
    """The validation-loss gap of run ``name`` to O0 at each evaluation, in percent: the
    mean over its seeds of the gap to O0 from the same seed. The steps and the gaps."""
    steps, gaps = seed_gap_curves(result, name)
    return steps, [statistics.fmean(per_seed) for per_seed in gaps]


def loss_figure(result: CompareResult) -> Any:
    """The panels of ``result`` (see the module docstring) as a matplotlib ``Figure``
    (close it when done).

    Raises:
        ModuleNotFoundError: when matplotlib is not installed, saying how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the loss-curve plot needs matplotlib; install it with pip install 'amp8[plot]'"
        ) from None
    window = max(1, result.config.train_loss_window // 2)
    baseline_ok = any(run.ok for run in result.runs_of(BASELINE))
    trained = [name for name in result.names() if any(run.ok for run in result.runs_of(name))]
    others = [name for name in trained if name != BASELINE and name not in LEVELS]
    panels = 4 if others and baseline_ok else 3
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    train_ax, val_ax, level_ax = axes[:3]
    other_ax = axes[3] if panels == 4 else None
    seeds = len(result.seeds)
    for name in trained:
        color = train_ax.plot(*mean_train_curve(result, name, window), label=name)[0].get_color()
        val_ax.plot(*mean_val_curve(result, name), marker="o", markersize=3, label=name, color=color)
        gap_ax = level_ax if name in LEVELS else other_ax
        if name == BASELINE or not baseline_ok or gap_ax is None:
            continue
        steps, per_seed = seed_gap_curves(result, name)
        gap_ax.plot(steps, [statistics.fmean(gaps) for gaps in per_seed], marker="o", markersize=3, label=name,
                    color=color)
        if seeds > 1:  # the seeds' spread
            gap_ax.fill_between(steps, [min(gaps) for gaps in per_seed], [max(gaps) for gaps in per_seed],
                                color=color, alpha=0.2, linewidth=0)
    over = f", mean over {seeds} seeds" if seeds > 1 else ""
    spread = " (band: the seeds' range)" if seeds > 1 else ""
    unit = result.loss_unit
    val_title = "validation loss" if result.has_validation else \
        f"train loss at evaluations (no eval_data; mean of {result.config.train_loss_window} steps)"
    train_ax.set(title=f"train loss (mean of {window} steps{over})", xlabel="step", ylabel=unit)
    val_ax.set(title=f"{val_title}{over}", xlabel="step", ylabel=unit)
    for gap_ax, which in ((level_ax, "opt levels"), (other_ax, "other runs")):
        if gap_ax is None:
            continue
        gap_ax.axhline(0.0, color="black", linewidth=0.8, label=BASELINE)
        loss = "validation-loss" if result.has_validation else "train-loss"
        gap_ax.set(title=f"{which}: {loss} gap to {BASELINE}{over}{spread}", xlabel="step",
                   ylabel=f"% of {BASELINE}'s loss")
        gap_ax.legend(fontsize="small")
    val_ax.legend()
    figure.suptitle(f"amp8 compare: {result.describe()}")
    figure.tight_layout()
    return figure


def plot_result(result: CompareResult, path: str | Path) -> Path:
    """Save the panels of ``result`` (``loss_figure``) as a PNG at ``path``;
    returns the path.

    Raises:
        ModuleNotFoundError: when matplotlib is not installed, saying how to get it.
    """
    figure = loss_figure(result)  # says how to get matplotlib when it is missing
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
