"""``amp8.compare(model=..., data=...)``: the comparison of opt levels on the user's own
model, optimizer, batches and loss.

One model is built per seed (under that seed) and deep-copied for every level, so the
levels of a seed start from the same weights; every run reads the batches from the start
with torch's random generators seeded alike (forked: the caller's generators are left as
they were), so a ``DataLoader`` that shuffles gives every level the same order. Each run
trains ``steps`` steps (``zero_grad``, the loss, ``backward``, ``step``, the scheduler),
measures the validation loss on ``eval_data`` at intervals, and ends with the precision
report of its model. A level that fails (``amp8.initialize`` refuses the optimizer, the
forward raises in FP8, ...) is recorded as failed with the reason and the other levels
train on; O0 failing is the user's setup failing, and raises.

Nothing runs per step beyond the training step itself but moving the batch to the
device, counting its samples and a fingerprint of a few of its elements (to say when a
level saw other batches than O0); the evaluation, the report and the outputs run once.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import LEVELS
from amp8.frontend import initialize
from amp8.monitor.console import default_console
from amp8.monitor.report import report
from amp8.nn import Fp8Linear
from amp8.nn.memory import count_saved_bytes
from amp8.tools.experiments.compare_config import DEFAULT_OUT, RunSpec
from amp8.tools.experiments.compare_output import check_out_dir, environment, finish, progress_bar
from amp8.tools.experiments.compare_result import CompareResult
from amp8.tools.experiments.paired import BASELINE, Variant, null_variant, paired_specs
from amp8.tools.experiments.train import RunResult, _perturb, _recipe_dict
from amp8.tools.experiments.user_batches import (
    compute_loss, count_items, fingerprint, fresh_pass, steps_of, to_device,
)
from amp8.tools.experiments.user_config import UserCompareConfig, describe_callable

class _StepError(Exception):
    """A run's failure, with the step it happened at (None: before the first step)."""

    def __init__(self, step: int | None, error: BaseException) -> None:
        super().__init__(str(error))
        self.step, self.error = step, error

    def describe(self) -> str:
        """The error and where it happened, on one line."""
        where = "while preparing the run" if self.step is None else f"at step {self.step}"
        return f"{type(self.error).__name__} {where}: {self.error}"


def run_specs(config: UserCompareConfig) -> list[RunSpec]:
    """The runs of ``config``, seed by seed: every level (O0 first, as it is, without the
    recipe) and, with several seeds, the null variant ``O0-null``."""
    variants = [Variant(level, level, None if level == BASELINE else config.recipe)
                for level in sorted(config.levels, key=list(LEVELS).index)]
    if config.seeds > 1:
        variants.append(null_variant())
    return paired_specs(variants, config.run_seeds)


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose generators a run forks (none off CUDA, so CUDA stays
    uninitialised on a CPU run)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def build_model(config: UserCompareConfig, seed: int) -> nn.Module:
    """The model of seed ``seed``: ``config.model()`` called under that seed (torch's
    generators forked, so the caller's are untouched), or ``config.model`` itself when it
    is a module (copied before each run, never trained).

    Raises:
        TypeError: the factory returned something other than an ``nn.Module``.
    """
    if isinstance(config.model, nn.Module):
        return config.model
    with torch.random.fork_rng(devices=_rng_devices(torch.device(config.device))):
        torch.manual_seed(seed)
        model = config.model()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model={describe_callable(config.model)} returned a {type(model).__name__}, not an nn.Module; "
            "pass a function that builds and returns a fresh model"
        )
    return model


def _evaluate(config: UserCompareConfig, model: nn.Module, device: torch.device) -> float:
    """The mean loss over ``config.eval_data``, in eval mode without gradients (train
    mode restored).

    Raises:
        ValueError: eval_data yielded no batch.
    """
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in fresh_pass(config.eval_data, "eval_data"):
            total += float(compute_loss(config.loss, model, to_device(batch, device)))
            count += 1
    model.train()
    if count == 0:
        raise ValueError("eval_data yielded no batches; give it at least one, or leave it out (eval_data=None)")
    return total / count


def train_user_run(
    spec: RunSpec,
    config: UserCompareConfig,
    base: nn.Module,
    reference: torch.Tensor | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[RunResult, torch.Tensor | None]:
    """Train one run of the user's model: a copy of ``base`` at ``spec``'s level, on
    ``config``'s batches, with its optimizer, loss and scheduler; measure it.

    ``reference``: the batch fingerprints O0 of the same seed saw (None for O0 itself);
    the run's ``batches_differ_at`` is the first step whose batch differs.

    Returns:
        the run's result (``status="unavailable"`` where ``amp8.initialize`` cannot do
        the level yet) and its batches' fingerprints.

    Raises:
        _StepError: the run failed, with the step and the error.
    """
    device = torch.device(config.device)
    level_name = spec.level if isinstance(spec.level, str) else spec.level.name
    fp8 = level_name != BASELINE
    result = RunResult(spec.name, level_name, spec.seed,
                       recipe=_recipe_dict(spec.recipe) if fp8 and spec.recipe is not None else None)
    cuda = device.type == "cuda"
    start = time.perf_counter()
    step: int | None = None
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(spec.seed)  # dropout and the data's shuffling: alike in every run of a seed
        try:
            try:
                model = copy.deepcopy(base).to(device)
            except Exception as error:
                raise TypeError(
                    f"the model could not be copied for this run (copy.deepcopy: {error}); pass model= as a "
                    "function that builds a fresh model"
                ) from error
            if spec.init_perturbation:
                _perturb(model, spec.init_perturbation)
            params = model.parameters()
            optimizer = torch.optim.AdamW(params) if config.optimizer is None else config.optimizer(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer={describe_callable(config.optimizer)} returned a {type(optimizer).__name__}, not a "
                    "torch.optim.Optimizer; pass params -> optimizer, e.g. lambda params: torch.optim.AdamW(params)"
                )
            if fp8:
                try:
                    model, returned = initialize(model, optimizer, spec.level, recipe=spec.recipe,
                                                 layer_selection="all")
                except NotImplementedError as error:
                    result.status, result.reason = "unavailable", str(error)
                    return result, None
                assert returned is not None  # initialize returns the optimizer it was given
                optimizer = returned
                if result.recipe is None:
                    result.recipe = next((_recipe_dict(m.recipe) for m in model.modules()
                                          if isinstance(m, Fp8Linear)), None)
            scheduler = None if config.scheduler is None else config.scheduler(optimizer)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            prints: list[torch.Tensor] = []
            train_time, samples, tokens = 0.0, 0, 0
            counted_tokens = True
            model.train()
            for step, batch in enumerate(steps_of(config.data, config.steps)):
                prints.append(fingerprint(batch))
                n_samples, n_tokens = count_items(batch)
                samples += n_samples or 0
                counted_tokens = counted_tokens and n_tokens is not None
                tokens += n_tokens or 0
                batch = to_device(batch, device)
                if cuda:
                    torch.cuda.synchronize(device)
                tic = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                with count_saved_bytes(model) if step == 0 else contextlib.nullcontext() as saved:
                    loss = compute_loss(config.loss, model, batch)
                if not loss.requires_grad:
                    raise ValueError(
                        "the loss does not depend on any trainable parameter (requires_grad is False); "
                        "compute it from the model's output"
                    )
                loss.backward()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                loss_value = float(loss.detach())  # also synchronizes
                train_time += time.perf_counter() - tic
                if saved is not None:
                    result.activation_bytes_per_sample = saved.bytes / n_samples if n_samples else None
                    result.activation_bytes_per_token = saved.bytes / n_tokens if n_tokens else None
                result.train_curve.append(loss_value)
                if config.eval_data is not None and ((step + 1) % config.eval_interval == 0  # type: ignore[operator]
                                                     or step + 1 == config.steps):
                    result.val_curve.append([step + 1, _evaluate(config, model, device)])
                if on_step is not None:
                    on_step(step, loss_value)
            step = None
            precision = report(model, optimizer, result.activation_bytes_per_token)
        except _StepError:
            raise
        except Exception as error:
            raise _StepError(step, error) from error
    window = min(config.train_loss_window, len(result.train_curve))
    result.final_train_loss = sum(result.train_curve[-window:]) / window
    result.final_val_loss = result.val_curve[-1][1] if result.val_curve else None
    result.train_s = train_time
    result.samples_per_s = samples / train_time if samples and train_time else None
    result.tokens_per_s = tokens / train_time if counted_tokens and tokens and train_time else None
    result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    result.bytes_per_param = precision.bytes_per_param
    result.fp8_share = precision.fp8_share
    result.skipped_steps = getattr(optimizer, "skipped_steps", None)
    result.highlights = precision.highlights()
    result.report_summary = precision.summary()
    result.report = precision.to_dict()
    stacked = torch.stack(prints) if prints and prints[0].numel() else None
    if reference is not None and stacked is not None and reference.shape == stacked.shape:
        differ = (reference != stacked).any(dim=1).nonzero()
        result.batches_differ_at = int(differ[0]) if len(differ) else None
    result.wall_s = time.perf_counter() - start
    return result, stacked


def compare_model(
    config: UserCompareConfig,
    *,
    out_dir: str | Path | None = DEFAULT_OUT,
    console: Any = None,
    progress: bool = True,
    plot: bool = True,
) -> CompareResult:
    """Train ``config``'s model at every level of ``config.levels`` from every seed,
    print the table and the recommendation, and write ``compare.json`` and
    ``loss_curves.png`` into ``out_dir`` (nothing when None).

    Raises:
        ValueError: ``out_dir`` cannot be created (before any training); data or a loss
            that O0 cannot train on (empty data, a loss that is not a scalar), naming it.
        TypeError: a model factory that returns no module, an optimizer factory that
            returns no optimizer, a loss that is not a tensor.
        RuntimeError: O0 of the first seed failed otherwise: the model as it is does not
            train, so there is nothing to compare against.
    """
    check_out_dir(out_dir)
    console = console or default_console()
    device = torch.device(config.device)
    specs = run_specs(config)
    bases: dict[int, nn.Module] = {}
    references: dict[int, torch.Tensor | None] = {}
    runs: list[RunResult] = []
    first_seed = config.run_seeds[0]
    with progress_bar(console, progress) as bar:
        task = bar.add_task("amp8 compare", total=len(specs) * config.steps, loss="-")
        for index, spec in enumerate(specs):
            seed = f" (seed {spec.seed})" if config.seeds > 1 else ""
            bar.update(task, description=f"[{index + 1}/{len(specs)}] {spec.name}{seed}")
            if spec.seed not in bases:
                bases = {spec.seed: build_model(config, spec.seed)}  # one seed's model at a time
                if config.name is None:
                    config = config.replace(name=type(bases[spec.seed]).__name__)

            def on_step(step: int, loss: float) -> None:
                bar.update(task, advance=1, loss=f"{loss:.3f}")

            baseline = spec.name == BASELINE
            try:
                result, prints = train_user_run(spec, config, bases[spec.seed],
                                                None if baseline else references.get(spec.seed), on_step)
            except _StepError as failure:
                if baseline and spec.seed == first_seed:
                    if isinstance(failure.error, (TypeError, ValueError)):
                        raise failure.error
                    raise RuntimeError(
                        f"O0 (your model as it is, no FP8) failed {failure.describe()}; every level is measured "
                        "against it, so fix the model, data or loss first"
                    ) from failure.error
                result, prints = RunResult(spec.name, str(spec.level), spec.seed, status="failed",
                                           reason=failure.describe()), None
            if baseline:
                references[spec.seed] = prints
            if not result.ok:
                bar.update(task, completed=(index + 1) * config.steps)
            runs.append(result)
    base = next(iter(bases.values()))
    corpus = {
        "model": config.name, "parameters": sum(p.numel() for p in base.parameters()),
        **{key: value for key, value in config.to_dict().items() if key in ("data", "eval_data", "loss", "optimizer")},
    }
    result = CompareResult(config, runs, corpus, environment(device))
    finish(result, out_dir, console, plot)
    return result
