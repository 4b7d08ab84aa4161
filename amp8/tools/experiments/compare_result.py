"""What an ``amp8 compare`` call measured: each run's result and the table, JSON and plot
of all of them.

With several seeds (``CompareConfig.seeds``) the runs of one name, one per seed, are
paired with O0 by seed (``amp8.tools.experiments.paired``): the table shows each name once,
its losses averaged over seeds and its gap to O0 as the mean paired gap ± its standard
error, and the null variant's gap says how far runs drift from rounding alone.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp8.config.recipe import ActivationFormat, Recipe
from amp8.monitor.console import default_console
from amp8.tools.experiments.compare_config import CompareConfig
from amp8.tools.experiments.paired import BASELINE, NULL, NULL_PERTURBATION, PairedResult
from amp8.tools.experiments.train import RunResult


@dataclass
class CompareResult:
    """Every run of a ``compare`` call, with the figures derived from them."""

    config: CompareConfig
    runs: list[RunResult]
    corpus: dict[str, Any]
    environment: dict[str, Any]

    def names(self) -> list[str]:
        """The names of the runs, in training order, once each (one name covers its seeds)."""
        return list(dict.fromkeys(result.name for result in self.runs))

    def runs_of(self, name: str) -> list[RunResult]:
        """Every seed's run called ``name``, in training order."""
        return [result for result in self.runs if result.name == name]

    def run(self, name: str, seed: int | None = None) -> RunResult:
        """The run called ``name`` (e.g. "O1", "O1-noscale", "O0-null") from ``seed``, or
        from the first seed it trained from when ``seed`` is None.

        Raises:
            KeyError: naming the runs there are (and their seeds, for an unknown seed).
        """
        runs = [result for result in self.runs_of(name) if seed is None or result.seed == seed]
        if not runs:
            seeds = ", ".join(str(result.seed) for result in self.runs_of(name))
            where = f"{name!r} from seed {seed} (it ran from seeds {seeds})" if seeds else repr(name)
            raise KeyError(f"no run {where}; the runs are {', '.join(self.names())}")
        return runs[0]

    @property
    def baseline(self) -> RunResult:
        """The O0 run from the first seed."""
        return self.run(BASELINE)

    @property
    def seeds(self) -> tuple[int, ...]:
        """The seeds O0 trained from."""
        return tuple(result.seed for result in self.runs_of(BASELINE))

    def gap_percent(self, name: str, seed: int | None = None) -> float | None:
        """Relative gap of a run's final validation loss to the O0 run of its seed, in
        percent (the run from the first seed when ``seed`` is None)."""
        result = self.run(name, seed)
        base = self.run(BASELINE, result.seed)
        if result.final_val_loss is None or base.final_val_loss is None:
            return None
        return 100 * (result.final_val_loss - base.final_val_loss) / base.final_val_loss

    def paired(self) -> PairedResult | None:
        """The final validation losses of every name that trained from every seed, paired
        with O0 by seed; None with one seed."""
        seeds = self.seeds
        if len(seeds) < 2:
            return None
        losses = {}
        for name in self.names():
            by_seed = {r.seed: r.final_val_loss for r in self.runs_of(name) if r.ok and r.final_val_loss is not None}
            if all(seed in by_seed for seed in seeds):
                losses[name] = [by_seed[seed] for seed in seeds]
        return PairedResult(self.config, seeds, (), losses)

    def o0_seed_losses(self) -> list[float]:
        """Final validation losses of O0 over every seed that ran."""
        return [r.final_val_loss for r in self.runs_of(BASELINE) if r.final_val_loss is not None]

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
        """Config, corpus, environment, every run of every seed (each with its gap to its
        seed's O0), the seed spread and, with several seeds, the paired gaps."""
        runs = []
        for result in self.runs:
            data = dataclasses.asdict(result)
            data["gap_percent"] = self.gap_percent(result.name, result.seed) if result.ok else None
            runs.append(data)
        paired = self.paired()
        return {
            "config": dataclasses.asdict(self.config),
            "corpus": self.corpus,
            "environment": self.environment,
            "runs": runs,
            "o0_seed_spread": self.o0_seed_spread(),
            "paired": None if paired is None else {"seeds": list(paired.seeds), "gaps": paired.summary()},
        }

    def write_json(self, path: str | Path) -> Path:
        """Write ``to_dict()`` to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def gap_text(self, name: str) -> str:
        """The table's gap to O0 of ``name``: "+0.12%" from one seed, "+0.12 ± 0.03%"
        (mean ± standard error of the paired gaps) from several; "-" for O0 itself."""
        paired = self.paired()
        if name == BASELINE:
            return "-"
        if paired is not None and name in paired.losses:
            return f"{_signed(paired.mean_gap_percent(name))} ± {paired.stderr_percent(name):.2f}%"
        gap = self.gap_percent(name)
        return "-" if gap is None else f"{_signed(gap)}%"

    def table(self) -> Any:
        """The comparison as a rich ``Table``, one row per run name; with several seeds
        the losses and tokens/s are means over the seeds that trained."""
        from rich.table import Table

        several = len(self.seeds) > 1
        caption = ("losses and tokens/s: mean over seeds; gap to O0: mean ± standard error of the "
                   "gaps to O0 from the same seed") if several else None
        table = Table(title=f"amp8 compare: {self.describe()}", caption=caption)
        for title in ("run", "train loss", "val loss", "gap to O0", "tokens/s", "peak mem",
                      "bytes/param", "act bytes/token", "FP8 share", "skipped"):
            table.add_column(title, justify="left" if title == "run" else "right", overflow="fold")
        for name in self.names():
            result, trained = self.run(name), [r for r in self.runs_of(name) if r.ok]
            if not result.ok:
                table.add_row(name, *["-"] * 8, "unavailable")
                continue

            def mean(key: str) -> float:
                return statistics.fmean(getattr(r, key) for r in trained)

            table.add_row(
                name,
                f"{mean('final_train_loss'):.4f}",
                f"{mean('final_val_loss'):.4f}",
                self.gap_text(name),
                f"{mean('tokens_per_s'):,.0f}",
                "-" if result.peak_memory_bytes is None else f"{result.peak_memory_bytes / 2**20:.0f} MiB",
                "-" if result.bytes_per_param is None else f"{result.bytes_per_param:.2f}",
                "-" if result.activation_bytes_per_token is None else f"{result.activation_bytes_per_token:,.0f}",
                "-" if result.fp8_share is None else f"{100 * result.fp8_share:.0f}%",
                "-" if result.skipped_steps is None else str(result.skipped_steps),
            )
        return table

    def describe(self) -> str:
        """One line: model shape, steps, batch, device, the seeds when several, and the
        recipe when one was given other than the tensorwise one."""
        c, m = self.config, self.config.model
        recipe = "" if c.recipe is None or c.recipe == Recipe() else f", {c.recipe.granularity.value} scaling"
        if c.recipe is not None and c.recipe.activations is ActivationFormat.FP8:
            recipe += ", FP8 activations"
        if c.stress is not None:
            recipe += f", outlier stress x2^{c.stress.max_log2_gain:g}"
        seeds = f", seeds {c.seed}-{c.seed + c.seeds - 1}" if c.seeds > 1 else ""
        return f"{m.name}, {c.steps} steps x {c.batch_size} seqs{seeds}, {c.device}{recipe}"

    def noise_floor(self) -> str:
        """The line under the table that says how far apart runs end from rounding alone:
        the null variant's paired gap with several seeds, how to measure it with one."""
        paired = self.paired()
        if paired is None or NULL not in paired.losses:
            return ("noise floor: one seed only; run with --seeds 3 for the mean ± standard error of each "
                    "gap over seeds and the null variant's gap beside them")
        return (f"noise floor: {NULL} (O0 from initial weights perturbed by {NULL_PERTURBATION:g} relative) ends "
                f"{self.gap_text(NULL)} from O0 over {len(paired.seeds)} seeds; a gap within a few standard "
                "errors of it is run-to-run drift, not FP8 error")

    def print(self, console: Any = None) -> None:
        """Print the table, unavailable runs with their reason, the noise floor (the null
        variant's gap) and the seed spread, and the first seed's precision-report
        highlights of each run."""
        console = console or default_console()
        console.print(self.table())
        for name in self.names():
            result = self.run(name)
            if not result.ok:
                console.print(f"{name} skipped: {result.reason}", highlight=False, markup=False)
        if all(r.peak_memory_bytes is None for r in self.runs if r.ok):
            console.print("peak mem: measured on CUDA only (torch keeps no allocator statistics on the CPU)",
                          highlight=False)
        console.print(self.noise_floor(), highlight=False)
        spread = self.o0_seed_spread()
        if spread is not None:
            console.print(
                f"O0 seed spread over {spread['seeds']} seeds: {spread['spread']:.4f} "
                f"({spread['spread_percent']:.2f}% of the mean {spread['mean']:.4f}); pairing each run "
                "with O0 from its seed takes it out of the gaps", highlight=False,
            )
        for name in self.names():
            result = self.run(name)
            if result.ok and result.highlights and name != NULL:
                console.print(f"[bold]{name}[/bold]: " + "; ".join(result.highlights))


def _signed(percent: float) -> str:
    """``percent`` to two decimals with its sign, "+0.00" for what rounds to zero."""
    return f"{round(percent, 2) + 0.0:+.2f}"
