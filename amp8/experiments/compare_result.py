"""What an ``amp8 compare`` call measured: each run's result and the table, JSON and plot
of all of them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..console import default_console
from ..recipe import ActivationFormat, Recipe
from .compare_config import TORCHAO, CompareConfig


@dataclass
class RunResult:
    """What one run measured. ``status`` is "ok" or "unavailable" (then ``reason`` says why).

    Losses are mean cross-entropy in nats per byte. ``train_curve`` holds one loss per
    step; ``val_curve`` holds ``[step, loss]`` pairs. ``peak_memory_bytes`` is measured on
    CUDA only (None elsewhere). ``activation_bytes_per_token`` is what autograd saved for
    backward in the first step's forward (``amp8.count_saved_bytes``), per token.
    ``report`` is the precision report of the final model. A run with a controller
    records its moves (``controller_moves``, as dicts) and the share of the FP8 layers'
    GEMM FLOPs still in FP8 at the end (``gemm_fp8_share``) and, per layer, the largest
    shares flushed and clipped it saw (``controller_peaks``).
    """

    name: str
    level: str
    seed: int
    status: str = "ok"
    reason: str | None = None
    recipe: dict[str, Any] | None = None
    train_curve: list[float] = field(default_factory=list)
    val_curve: list[list[float]] = field(default_factory=list)
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    bytes_per_param: float | None = None
    activation_bytes_per_token: float | None = None
    fp8_share: float | None = None
    skipped_steps: int | None = None
    wall_s: float | None = None
    highlights: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    controller_moves: list[dict[str, Any]] | None = None
    gemm_fp8_share: float | None = None
    controller_peaks: dict[str, dict[str, float]] | None = None

    @property
    def ok(self) -> bool:
        """Whether the run trained."""
        return self.status == "ok"


@dataclass
class CompareResult:
    """Every run of a ``compare`` call, with the figures derived from them."""

    config: CompareConfig
    runs: list[RunResult]
    corpus: dict[str, Any]
    environment: dict[str, Any]

    def run(self, name: str) -> RunResult:
        """The run called ``name`` (e.g. "O1", "O1-noscale", "O0-seed1").

        Raises:
            KeyError: naming the runs there are.
        """
        for result in self.runs:
            if result.name == name:
                return result
        raise KeyError(f"no run named {name!r}; the runs are {', '.join(r.name for r in self.runs)}")

    @property
    def baseline(self) -> RunResult:
        """The O0 run from the configured seed."""
        return self.run("O0")

    def gap_percent(self, name: str) -> float | None:
        """Relative gap of a run's final validation loss to O0's, in percent."""
        result, base = self.run(name), self.baseline
        if result.final_val_loss is None or base.final_val_loss is None:
            return None
        return 100 * (result.final_val_loss - base.final_val_loss) / base.final_val_loss

    def o0_seed_losses(self) -> list[float]:
        """Final validation losses of O0 over every seed that ran."""
        return [
            r.final_val_loss for r in self.runs
            if r.level == "O0" and not r.name.startswith(TORCHAO) and r.final_val_loss is not None
        ]

    def o0_seed_spread(self) -> dict[str, float] | None:
        """O0's seed-to-seed spread (max - min of final validation loss), absolute and in
        percent of the mean; None with a single seed."""
        losses = self.o0_seed_losses()
        if len(losses) < 2:
            return None
        mean = sum(losses) / len(losses)
        spread = max(losses) - min(losses)
        return {"seeds": len(losses), "min": min(losses), "max": max(losses), "mean": mean,
                "spread": spread, "spread_percent": 100 * spread / mean}

    def to_dict(self) -> dict[str, Any]:
        """Config, corpus, environment, every run and the seed spread as plain data."""
        runs = []
        for result in self.runs:
            data = dataclasses.asdict(result)
            data["gap_percent"] = self.gap_percent(result.name) if result.ok else None
            runs.append(data)
        return {
            "config": dataclasses.asdict(self.config),
            "corpus": self.corpus,
            "environment": self.environment,
            "runs": runs,
            "o0_seed_spread": self.o0_seed_spread(),
        }

    def write_json(self, path: str | Path) -> Path:
        """Write ``to_dict()`` to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def table(self) -> Any:
        """The comparison as a rich ``Table``, one row per run."""
        from rich.table import Table

        table = Table(title=f"amp8 compare: {self.describe()}")
        for title in ("run", "train loss", "val loss", "gap to O0", "tokens/s", "peak mem",
                      "bytes/param", "act bytes/token", "FP8 share", "skipped"):
            table.add_column(title, justify="left" if title == "run" else "right", overflow="fold")
        for result in self.runs:
            if not result.ok:
                table.add_row(result.name, *["-"] * 8, "unavailable")
                continue
            gap = self.gap_percent(result.name)
            table.add_row(
                result.name,
                f"{result.final_train_loss:.4f}",
                f"{result.final_val_loss:.4f}",
                "-" if result.name == "O0" or gap is None else f"{gap:+.2f}%",
                f"{result.tokens_per_s:,.0f}",
                "-" if result.peak_memory_bytes is None else f"{result.peak_memory_bytes / 2**20:.0f} MiB",
                "-" if result.bytes_per_param is None else f"{result.bytes_per_param:.2f}",
                "-" if result.activation_bytes_per_token is None else f"{result.activation_bytes_per_token:,.0f}",
                "-" if result.fp8_share is None else f"{100 * result.fp8_share:.0f}%",
                "-" if result.skipped_steps is None else str(result.skipped_steps),
            )
        return table

    def describe(self) -> str:
        """One line: model shape, steps, batch, device, and the recipe when not the default."""
        c, m = self.config, self.config.model
        recipe = "" if c.recipe == Recipe() else f", {c.recipe.granularity.value} scaling"
        if c.recipe.activations is ActivationFormat.FP8:
            recipe += ", FP8 activations"
        if c.stress is not None:
            recipe += f", outlier stress x2^{c.stress.max_log2_gain:g}"
        return f"{m.name}, {c.steps} steps x {c.batch_size} seqs, {c.device}{recipe}"

    def print(self, console: Any = None) -> None:
        """Print the table, unavailable runs with their reason, the seed spread, and each
        run's precision-report highlights."""
        console = console or default_console()
        console.print(self.table())
        for result in self.runs:
            if not result.ok:
                console.print(f"{result.name} skipped: {result.reason}", highlight=False, markup=False)
        if all(r.peak_memory_bytes is None for r in self.runs if r.ok):
            console.print("peak mem: measured on CUDA only (torch keeps no allocator statistics on the CPU)",
                          highlight=False)
        spread = self.o0_seed_spread()
        if spread is None:
            console.print("O0 seed spread: one seed only; run with --seeds 3 to tell a real gap from noise",
                          highlight=False)
        else:
            console.print(
                f"O0 seed spread over {spread['seeds']} seeds: {spread['spread']:.4f} "
                f"({spread['spread_percent']:.2f}% of the mean {spread['mean']:.4f}); "
                "gaps smaller than this are noise", highlight=False,
            )
        for result in self.runs:
            if result.ok and result.highlights and not result.name.startswith("O0-seed"):
                console.print(f"[bold]{result.name}[/bold]: " + "; ".join(result.highlights))

    def plot(self, path: str | Path) -> Path:
        """Save the train and validation loss curves of every run as a PNG.

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
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
        window = max(1, self.config.train_loss_window // 2)
        for result in self.runs:
            if not result.ok:
                continue
            curve = torch.tensor(result.train_curve)
            smooth = curve.unfold(0, window, 1).mean(dim=1) if len(curve) >= window else curve
            train_ax.plot(range(window - 1, window - 1 + len(smooth)), smooth.tolist(), label=result.name)
            steps, losses = zip(*result.val_curve)
            val_ax.plot(steps, losses, marker="o", markersize=3, label=result.name)
        train_ax.set(title=f"train loss (mean of {window} steps)", xlabel="step", ylabel="nats/byte")
        val_ax.set(title="validation loss", xlabel="step", ylabel="nats/byte")
        val_ax.legend()
        figure.suptitle(f"amp8 compare: {self.describe()}")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return path
