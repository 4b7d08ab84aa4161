"""Paired gaps to O0: each variant trains from the same seeds as O0, on the same batches.

A configuration (a ``CompareConfig``: model, corpus, learning-rate schedule, decay) is
trained at O0 and at every ``Variant`` from each seed; a variant's gap for a seed is
``(its final validation loss - O0's from that seed) / O0's``, and its paired gap is the
mean over seeds. Pairing removes the seed-to-seed spread (the initial weights and the
batch order are the same within a pair), so a gap a tenth of that spread still shows.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from amp8.config.levels import OptLevel
from amp8.config.recipe import Recipe
from amp8.tools.experiments.compare_config import CompareConfig, RunSpec
from amp8.tools.experiments.corpus import load_corpus
from amp8.tools.experiments.train import _recipe_dict, train_run, validation_batches

BASELINE = "O0"


@dataclass(frozen=True)
class Variant:
    """One way to train: a name, an opt level (a name or an ``OptLevel``), a recipe (None
    for ``amp8.initialize``'s default), and a relative perturbation of the initial
    weights (``RunSpec.init_perturbation``; the null variant ``null_variant()`` is O0 with
    one of 1e-6), or torchao's float8 training under its recipe ``torchao``
    ("tensorwise", "rowwise") instead of amp8."""

    name: str
    level: str | OptLevel
    recipe: Recipe | None = None
    init_perturbation: float = 0.0
    torchao: str | None = None

    def spec(self, seed: int) -> RunSpec:
        """The run of this variant from ``seed``."""
        return RunSpec(self.name, self.level, seed, self.recipe, torchao=self.torchao is not None,
                       init_perturbation=self.init_perturbation, torchao_recipe=self.torchao or "tensorwise")

    def describe(self) -> dict[str, Any]:
        """The variant as plain data, for JSON."""
        level = self.level if isinstance(self.level, str) else {
            key: getattr(value, "value", value) for key, value in dataclasses.asdict(self.level).items()
            if key not in ("brief", "description")
        }
        recipe = None if self.recipe is None else _recipe_dict(self.recipe)
        return {"name": self.name, "level": level, "recipe": recipe,
                "init_perturbation": self.init_perturbation, "torchao": self.torchao}


NULL = "O0-null"
NULL_PERTURBATION = 1e-6


def null_variant() -> Variant:
    """O0 from initial weights perturbed by 1e-6 relative (16 float32 ulps): its gap to
    O0 is what run-to-run drift alone gives, the floor a paired gap can be read against."""
    return Variant(NULL, BASELINE, init_perturbation=NULL_PERTURBATION)


def paired_specs(variants: Sequence[Variant], seeds: Sequence[int]) -> list[RunSpec]:
    """The runs of every variant from every seed, seed by seed: all of one seed's runs
    end before the next seed's begin, so a study cut short still holds whole pairs."""
    return [variant.spec(seed) for seed in seeds for variant in variants]


def gaps_percent(losses: Mapping[str, Sequence[float]], name: str) -> list[float]:
    """The gap of variant ``name`` to O0, seed by seed, in percent: ``losses`` maps each
    variant (O0 as ``"O0"``) to its validation losses (final, or at one evaluation of
    the curve), one per seed, in the same order of seeds.

    Raises:
        KeyError: for a variant ``losses`` lacks, naming those it has.
    """
    if name not in losses:
        raise KeyError(f"no variant named {name!r}; the variants are {', '.join(losses)}")
    return [100 * (loss - base) / base for loss, base in zip(losses[name], losses[BASELINE], strict=True)]


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of ``values`` (their sample standard deviation over
    the square root of their count); None for fewer than two values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


@dataclass
class PairedResult:
    """Final validation losses per variant and seed, O0 included (as ``"O0"``), with the
    final train losses (mean of the last ``train_loss_window`` steps), steps skipped on
    overflow and wall times beside them."""

    config: CompareConfig
    seeds: tuple[int, ...]
    variants: tuple[Variant, ...]
    losses: dict[str, list[float]] = field(default_factory=dict)
    train_losses: dict[str, list[float]] = field(default_factory=dict)
    skipped_steps: dict[str, list[int]] = field(default_factory=dict)
    wall_s: dict[str, list[float]] = field(default_factory=dict)

    def gaps_percent(self, name: str) -> list[float]:
        """The gap to O0 of each seed, in percent.

        Raises:
            KeyError: for a variant that did not train, naming those that did.
        """
        return gaps_percent(self.losses, name)

    def mean_gap_percent(self, name: str) -> float:
        """The paired gap: the mean over seeds of the gap to O0, in percent."""
        return statistics.fmean(self.gaps_percent(name))

    def stderr_percent(self, name: str) -> float | None:
        """The standard error of the paired gap, in percent; None with one seed."""
        return standard_error(self.gaps_percent(name))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per variant other than O0: its gaps per seed, their mean and standard error."""
        return {name: {"gaps_percent": self.gaps_percent(name), "mean_gap_percent": self.mean_gap_percent(name),
                       "stderr_percent": self.stderr_percent(name)}
                for name in self.losses if name != BASELINE}

    def to_dict(self) -> dict[str, Any]:
        """Configuration, seeds, losses, per-seed and mean gaps as plain data."""
        config = dataclasses.asdict(self.config)
        for key in ("seed", "seeds", "levels", "ablation", "torchao"):
            config.pop(key)
        return {
            "config": config,
            "seeds": list(self.seeds),
            "variants": [variant.describe() for variant in self.variants],
            "losses": self.losses,
            "train_losses": self.train_losses,
            **{key: {name: row[key] for name, row in self.summary().items()}
               for key in ("gaps_percent", "mean_gap_percent", "stderr_percent")},
            "skipped_steps": self.skipped_steps,
            "wall_s": self.wall_s,
        }


def paired_runs(
    config: CompareConfig,
    variants: Sequence[Variant],
    seeds: Sequence[int] = (0, 1, 2),
    on_run: Callable[[str, int, float], None] | None = None,
    baseline: Sequence[float] | None = None,
) -> PairedResult:
    """Train O0 and every variant from each seed under ``config`` (its ``seed``,
    ``seeds``, ``levels``, ``ablation`` and ``torchao`` fields are not used).

    Args:
        config: model, corpus, steps, batch size, schedule and decay.
        variants: what to pair with O0 (a variant named "O0" is not allowed).
        seeds: the seeds of the initial weights and batch order.
        on_run: called with (variant name, seed, final validation loss) after each run.
        baseline: O0's final validation losses from ``seeds`` under ``config``, when
            already measured (O0 is then not trained again).

    Raises:
        ValueError: no seeds, a variant named "O0", or two variants of one name.
        RuntimeError: a variant that ``amp8.initialize`` refused.
    """
    names = [variant.name for variant in variants]
    if not seeds or BASELINE in names or len(set(names)) != len(names):
        raise ValueError(
            f"paired_runs needs at least one seed and variants of distinct names other than "
            f"{BASELINE!r}; got seeds={list(seeds)}, variants {names}"
        )
    corpus = load_corpus(config.corpus)
    val_batches = validation_batches(config, corpus)
    if baseline is not None and len(baseline) != len(seeds):
        raise ValueError(f"baseline holds {len(baseline)} losses for {len(seeds)} seeds; give one per seed")
    result = PairedResult(config, tuple(seeds), tuple(variants))
    if baseline is not None:
        result.losses[BASELINE] = [float(loss) for loss in baseline]
    to_train = (*([] if baseline is not None else [Variant(BASELINE, BASELINE)]), *variants)
    for spec in paired_specs(to_train, seeds):
        run = train_run(spec, config, corpus, val_batches)
        if not run.ok or run.final_val_loss is None:
            raise RuntimeError(f"variant {spec.name!r} did not train: {run.reason}")
        result.losses.setdefault(spec.name, []).append(run.final_val_loss)
        result.train_losses.setdefault(spec.name, []).append(run.final_train_loss or math.nan)
        result.skipped_steps.setdefault(spec.name, []).append(run.skipped_steps or 0)
        result.wall_s.setdefault(spec.name, []).append(run.wall_s or 0.0)
        if on_run is not None:
            on_run(spec.name, spec.seed, run.final_val_loss)
    return result
