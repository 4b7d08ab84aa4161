"""What an ``amp8 compare`` call measured: each run's result and the table, JSON and plot
of all of them.

With several seeds (``CompareConfig.seeds``) the runs of one name, one per seed, are
paired with O0 by seed (``amp8.tools.experiments.paired``): the table shows each name once,
its losses averaged over seeds and its gap to O0 as the mean paired gap ± its standard
error, and the null variant's gap says how far runs drift from rounding alone.

The same result holds a comparison of the user's own model (``UserCompareConfig``):
its gaps are of the final validation loss when ``eval_data`` was given, else of the
final train loss, and its throughput is in samples/s (tokens/s when batches hold
``input_ids``). Either way ``recommended`` says which level to use and why
(``amp8.tools.experiments.recommend``).
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
from amp8.tools.experiments.recommend import Recommendation, recommend
from amp8.tools.experiments.train import RunResult
from amp8.tools.experiments.user_config import UserCompareConfig


@dataclass
class CompareResult:
    """Every run of a ``compare`` call, with the figures derived from them. ``corpus``
    describes the data: the built-in corpus, or the user's model and batches."""

    config: CompareConfig | UserCompareConfig
    runs: list[RunResult]
    corpus: dict[str, Any]
    environment: dict[str, Any]

    @property
    def user_model(self) -> bool:
        """Whether this compared the user's own model (``amp8.compare(model=..., data=...)``)."""
        return isinstance(self.config, UserCompareConfig)

    @property
    def has_validation(self) -> bool:
        """Whether the gaps are of a validation loss (always for the built-in models;
        for the user's own model when ``eval_data`` was given)."""
        return not isinstance(self.config, UserCompareConfig) or self.config.has_validation

    @property
    def loss_unit(self) -> str:
        """What the losses are measured in, for the plot's axes."""
        return "loss" if self.user_model else "nats/byte"

    def final_loss(self, result: RunResult) -> float | None:
        """The loss a run's gap is of: its final validation loss, or its final train
        loss when there was no validation data."""
        return result.final_val_loss if self.has_validation else result.final_train_loss

    @property
    def recommended(self) -> Recommendation:
        """The level to use and why: the fewest bytes per parameter among the levels
        within ``config.threshold_percent`` of O0 (or within the noise floor with
        several seeds); O0 with the reason when none is (``amp8.tools.experiments.recommend``)."""
        return recommend(self, self.config.threshold_percent)

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
        loss, base_loss = self.final_loss(result), self.final_loss(base)
        if loss is None or base_loss is None:
            return None
        return 100 * (loss - base_loss) / base_loss

    def paired(self) -> PairedResult | None:
        """The final validation losses of every name that trained from every seed, paired
        with O0 by seed; None with one seed."""
        seeds = self.seeds
        if len(seeds) < 2:
            return None
        losses = {}
        for name in self.names():
            by_seed = {r.seed: self.final_loss(r) for r in self.runs_of(name) if r.ok and self.final_loss(r) is not None}
            if all(seed in by_seed for seed in seeds):
                losses[name] = [by_seed[seed] for seed in seeds]
        return PairedResult(self.config, seeds, (), losses)  # type: ignore[arg-type]

    def o0_seed_losses(self) -> list[float]:
        """Final validation losses (train losses without validation data) of O0 over every seed that ran."""
        return [loss for r in self.runs_of(BASELINE) if (loss := self.final_loss(r)) is not None]

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
        seed's O0), the seed spread, with several seeds the paired gaps, and the
        recommendation."""
        runs = []
        for result in self.runs:
            data = dataclasses.asdict(result)
            data["gap_percent"] = self.gap_percent(result.name, result.seed) if result.ok else None
            runs.append(data)
        paired = self.paired()
        config = self.config.to_dict() if isinstance(self.config, UserCompareConfig) else dataclasses.asdict(self.config)
        return {
            "config": config,
            "corpus": self.corpus,
            "environment": self.environment,
            "runs": runs,
            "o0_seed_spread": self.o0_seed_spread(),
            "paired": None if paired is None else {"seeds": list(paired.seeds), "gaps": paired.summary()},
            "recommended": self.recommended.to_dict(),
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

    def throughput_unit(self) -> str:
        """"tokens" when every run that trained counted tokens (the built-in models, or
        batches with ``input_ids``), else "samples"."""
        trained = [r for r in self.runs if r.ok]
        return "tokens" if all(r.tokens_per_s is not None for r in trained) else "samples"

    def table(self) -> Any:
        """The comparison as a rich ``Table``, one row per run name; with several seeds
        the losses and tokens/s (samples/s) are means over the seeds that trained."""
        from rich.table import Table

        several = len(self.seeds) > 1
        unit = self.throughput_unit()
        captions = []
        if several:
            captions.append(f"losses and {unit}/s: mean over seeds; gap to O0: mean ± standard error of the "
                            "gaps to O0 from the same seed")
        if not self.has_validation:
            captions.append("no eval_data: gaps are of the final train loss")
        table = Table(title=f"amp8 compare: {self.describe()}", caption="; ".join(captions) or None)
        act = "act bytes/token" if unit == "tokens" else "act bytes/sample"
        for title in ("run", "train loss", "val loss", "gap to O0", f"{unit}/s", "peak mem",
                      "bytes/param", act, "FP8 share", "skipped"):
            table.add_column(title, justify="left" if title == "run" else "right", overflow="fold")
        for name in self.names():
            result, trained = self.run(name), [r for r in self.runs_of(name) if r.ok]
            if not trained:
                table.add_row(name, *["-"] * 8, result.status)
                continue
            if not result.ok:  # the first seed failed, a later one trained: show what trained
                result = trained[0]

            def mean(key: str) -> float | None:
                values = [getattr(r, key) for r in trained if getattr(r, key) is not None]
                return statistics.fmean(values) if values else None

            val, speed = mean("final_val_loss"), mean(f"{unit}_per_s")
            act_bytes = result.activation_bytes_per_token if unit == "tokens" else result.activation_bytes_per_sample
            table.add_row(
                name,
                f"{mean('final_train_loss'):.4f}",
                "-" if val is None else f"{val:.4f}",
                self.gap_text(name),
                "-" if speed is None else f"{speed:,.0f}",
                "-" if result.peak_memory_bytes is None else f"{result.peak_memory_bytes / 2**20:.0f} MiB",
                "-" if result.bytes_per_param is None else f"{result.bytes_per_param:.2f}",
                "-" if act_bytes is None else f"{act_bytes:,.0f}",
                "-" if result.fp8_share is None else f"{100 * result.fp8_share:.0f}%",
                "-" if result.skipped_steps is None else str(result.skipped_steps),
            )
        return table

    def describe(self) -> str:
        """One line: model shape (or the user's model), steps, batch, device, the seeds
        when several, and the recipe when one was given other than the tensorwise one."""
        if isinstance(self.config, UserCompareConfig):
            return self.config.describe()
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
        """Print the table, failed and unavailable runs with their reason, the noise floor
        (the null variant's gap) and the seed spread, the first seed's precision-report
        summary (the user's own model) and highlights of each run, and the recommendation."""
        console = console or default_console()
        console.print(self.table())
        for result in self.runs:
            if result.status == "failed":
                seed = f" (seed {result.seed})" if len(self.seeds) > 1 else ""
                console.print(f"{result.name}{seed} failed: {result.reason}", highlight=False, markup=False)
        for name in self.names():
            result = self.run(name)
            if not result.ok and result.status != "failed":
                console.print(f"{name} skipped: {result.reason}", highlight=False, markup=False)
            elif result.batches_differ_at is not None:
                console.print(
                    f"{name} saw other batches than O0 from step {result.batches_differ_at}: the data is not "
                    "the same on every pass (seeded by something other than torch?), so its gap mixes FP8 "
                    "error with a different data order", highlight=False, markup=False,
                )
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
            if result.ok and result.report_summary and name != NULL:
                console.print(f"[bold]{name}[/bold]: {result.report_summary}", highlight=False)
            if result.ok and result.highlights and name != NULL:
                console.print(f"[bold]{name}[/bold]: " + "; ".join(result.highlights))
        console.print(str(self.recommended), highlight=False, markup=False)


def _signed(percent: float) -> str:
    """``percent`` to two decimals with its sign, "+0.00" for what rounds to zero."""
    return f"{round(percent, 2) + 0.0:+.2f}"
