"""The PNG of an ``amp8 compare`` call: three panels side by side, the train loss, the
validation loss, and each run's validation-loss gap to O0 in percent with a zero line.

The loss curves of runs that differ by FP8 rounding lie on one another at the scale of
the loss; the gap panel draws what tells them apart. Each curve is the mean over the
seeds its run trained from, and each gap is taken against O0 from the same seed.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from amp8.tools.experiments.paired import BASELINE, gaps_percent

if TYPE_CHECKING:
    from amp8.tools.experiments.compare_result import CompareResult


def mean_train_curve(result: "CompareResult", name: str, window: int) -> tuple[list[int], list[float]]:
    """The train loss of run ``name``, averaged over its seeds and then over a sliding
    window of ``window`` steps: the steps (0-based, the window's last) and the losses."""
    curves = torch.tensor([r.train_curve for r in result.runs_of(name) if r.ok])  # (seeds, steps)
    curve = curves.mean(dim=0)
    smooth = curve.unfold(0, window, 1).mean(dim=1) if len(curve) >= window else curve
    first = window - 1 if len(curve) >= window else 0
    return list(range(first, first + len(smooth))), smooth.tolist()


def mean_val_curve(result: "CompareResult", name: str) -> tuple[list[float], list[float]]:
    """The validation loss of run ``name`` at each evaluation, averaged over its seeds:
    the steps and the losses."""
    curves = [r.val_curve for r in result.runs_of(name) if r.ok]
    steps = [step for step, _ in curves[0]]
    return steps, [statistics.fmean(curve[i][1] for curve in curves) for i in range(len(steps))]


def gap_curve(result: "CompareResult", name: str) -> tuple[list[float], list[float]]:
    """The validation-loss gap of run ``name`` to O0 at each evaluation, in percent: the
    mean over its seeds of the gap to O0 from the same seed. The steps and the gaps."""
    pairs = [(run, result.run(BASELINE, run.seed)) for run in result.runs_of(name) if run.ok]
    pairs = [(run, base) for run, base in pairs if base.ok]
    steps = [step for step, _ in pairs[0][0].val_curve]
    gaps = []
    for i in range(len(steps)):
        losses = {name: [run.val_curve[i][1] for run, _ in pairs], BASELINE: [base.val_curve[i][1] for _, base in pairs]}
        gaps.append(statistics.fmean(gaps_percent(losses, name)))
    return steps, gaps


def loss_figure(result: "CompareResult") -> Any:
    """The three panels of ``result`` as a matplotlib ``Figure`` (close it when done).

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
    figure, (train_ax, val_ax, gap_ax) = plt.subplots(1, 3, figsize=(18, 4.5))
    window = max(1, result.config.train_loss_window // 2)
    baseline_ok = any(run.ok for run in result.runs_of(BASELINE))
    for name in result.names():
        if not any(run.ok for run in result.runs_of(name)):
            continue
        train_ax.plot(*mean_train_curve(result, name, window), label=name)
        val_ax.plot(*mean_val_curve(result, name), marker="o", markersize=3, label=name)
        if name != BASELINE and baseline_ok:
            gap_ax.plot(*gap_curve(result, name), marker="o", markersize=3, label=name)
        else:  # O0 is the zero line: skip its colour so each run keeps one colour in every panel
            gap_ax.plot([], [])
    seeds = len(result.seeds)
    over = f", mean over {seeds} seeds" if seeds > 1 else ""
    gap_ax.axhline(0.0, color="black", linewidth=0.8, label=BASELINE)
    train_ax.set(title=f"train loss (mean of {window} steps{over})", xlabel="step", ylabel="nats/byte")
    val_ax.set(title=f"validation loss{over}", xlabel="step", ylabel="nats/byte")
    gap_ax.set(title=f"validation-loss gap to {BASELINE}{over}", xlabel="step", ylabel=f"% of {BASELINE}'s loss")
    val_ax.legend()
    gap_ax.legend(fontsize="small")
    figure.suptitle(f"amp8 compare: {result.describe()}")
    figure.tight_layout()
    return figure


def plot_result(result: "CompareResult", path: str | Path) -> Path:
    """Save the three panels of ``result`` (``loss_figure``) as a PNG at ``path``;
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
