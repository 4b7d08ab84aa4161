"""``amp8.compare``: train the same model from the same seeds at every opt level and compare.

``amp8.compare(model=..., data=..., ...)`` does it on the user's own model, optimizer,
batches and loss (``amp8.tools.experiments.user_model``); without them, on amp8's
built-in models, as described below. Either way the result's ``recommended`` says which
level to use and why (``amp8.tools.experiments.recommend``).

Every run builds the model (by default the byte-level GPT with an output head of its own)
from a seed, draws that seed's batches from the corpus, and trains with AdamW under the
same learning-rate schedule; only the opt level (or recipe) differs. Runs:

- ``O0`` ... ``O3``: the levels of ``amp8.LEVELS`` that were asked for. A level that
  ``amp8.initialize`` refuses with ``NotImplementedError`` is recorded as unavailable;
- ``O1-noscale``: O1 with ``Recipe(scaling="none")``, FP8 casts without scales, an
  ablation that shows why scaling matters; under a microscaled recipe instead one O1 run
  without each of its knobs that is on (``O1-no-hadamard``, ``O1-no-sr``);
- ``torchao``, ``torchao-rowwise``: torchao's float8 training on the same model under its
  tensorwise and rowwise recipes, when torchao is importable;
- ``O0-null`` (``seeds > 1``): O0 from initial weights perturbed by 1e-6 relative, whose
  gap to O0 is the drift of runs that differ by rounding alone (``paired.null_variant``);
- ``<level>+controller``: a level of ``controller_levels`` again with an
  ``amp8.Controller``, which records its moves and the share of GEMM FLOPs left in FP8.

With ``seeds > 1`` the levels, the torchao runs and ``O0-null`` train from every seed,
each paired with O0 from the same seed (``amp8.tools.experiments.paired``); the ablations and
the controller runs train from the first seed only.

With ``CompareConfig.stress`` set, every run (O0 included) trains under the same outlier
injection (``amp8.tools.experiments.stress``) and its position is left out of the training and
validation loss.

The results hold every loss curve and figure; ``write_json`` and ``plot`` save them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from amp8.config.recipe import ActivationFormat, Microscaling, Recipe
from amp8.monitor.console import default_console
from amp8.monitor.report import PrecisionReport
from amp8.tools.experiments.compare_config import (
    ABLATION, DEFAULT_OUT, JSON_NAME, KNOB_ABLATIONS, MODELS, PNG_NAME, TORCHAO, TORCHAO_RUNS, _VAL_SEED,
    CompareConfig, RunSpec, model_config,
)
from amp8.tools.experiments.compare_output import check_out_dir, environment, finish, progress_bar
from amp8.tools.experiments.compare_result import CompareResult
from amp8.tools.experiments.corpus import load_corpus
from amp8.tools.experiments.gpt import GPTConfig
from amp8.tools.experiments.llama import LlamaSpec
from amp8.tools.experiments.paired import BASELINE, Variant, null_variant, paired_specs
from amp8.tools.experiments.train import (
    RunResult, _param_groups, _recipe_dict, evaluate, torchao_available, train_run, validation_batches,
)
from amp8.tools.experiments.user_config import UserCompareConfig
from amp8.tools.experiments.user_model import compare_model


def run_specs(config: CompareConfig) -> list[RunSpec]:
    """The runs ``config`` asks for, in the order they train: from the first seed every
    run, then from each other seed the levels, the torchao runs and the null variant.
    O0 is the baseline as the model is: it keeps its activations as they are whatever the
    recipe says."""
    levels = [Variant(level, level, _baseline_recipe(config) if level == BASELINE else config.recipe)
              for level in config.levels]
    peers = []
    if config.torchao and torchao_available():
        peers += [Variant(name, BASELINE, torchao=recipe) for recipe, name in TORCHAO_RUNS.items()]
    if config.seeds > 1:
        peers.append(null_variant())
    first, *others = config.run_seeds
    specs = [variant.spec(first) for variant in (*levels, *_ablations(config), *peers)]
    specs += [RunSpec(f"{level}+controller", level, first, config.recipe, controller=config.controller)
              for level in config.controller_levels]
    return specs + paired_specs([*levels, *peers], others)


def _baseline_recipe(config: CompareConfig) -> Recipe | None:
    """O0's recipe: the configuration's with its activations as the model keeps them."""
    return None if config.recipe is None else config.recipe.replace(activations=ActivationFormat.HIGH)


def _ablations(config: CompareConfig) -> list[Variant]:
    """O1 without scaling or, under a microscaled recipe (whose scaling is fixed), O1
    without each of its knobs that is on; none when ``config.ablation`` is off."""
    if not config.ablation:
        return []
    recipe = Recipe() if config.recipe is None else config.recipe
    if recipe.microscaling is Microscaling.NONE:
        return [Variant(ABLATION, "O1", recipe.replace(scaling="none"))]
    return [Variant(name, "O1", recipe.replace(**{knob: False}))
            for knob, name in KNOB_ABLATIONS.items() if getattr(recipe, knob)]


def missing_peer_note(config: CompareConfig) -> str | None:
    """The line that says torchao's float8 peer is left out because torchao is not
    installed (None when it runs, or when ``config`` does not ask for it)."""
    if not config.torchao or torchao_available():
        return None
    return ("torchao is not installed: its float8 training is left out of the comparison "
            "(pip install torchao to add it, --no-torchao to silence this)")


def compare(
    config: CompareConfig | UserCompareConfig | None = None,
    *,
    model: Any = None,
    data: Any = None,
    optimizer: Any = None,
    loss: Any = None,
    eval_data: Any = None,
    steps: int | None = None,
    levels: Sequence[str] | None = None,
    seeds: int | None = None,
    out_dir: str | Path | None = DEFAULT_OUT,
    console: Any = None,
    progress: bool = True,
    plot: bool = True,
    **options: Any,
) -> CompareResult:
    """Train the same model from the same seeds at every opt level, print the table and
    the recommended level, and save the results: on your own model and data, or on
    amp8's built-in models.

    On your own model (``amp8.tools.experiments.user_model``)::

        result = amp8.compare(
            model=build_model,            # () -> a fresh nn.Module, or an nn.Module (copied for every run)
            optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),   # default: AdamW, torch's defaults
            data=train_batches,           # a list, a DataLoader: every run sees the same batches in order
            loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),  # default: model(**batch).loss
            eval_data=val_batches,        # optional: validation loss at intervals and at the end
            steps=200, levels=("O0", "O1", "O2", "O3"), seeds=1, out_dir="runs/compare",
        )
        print(result.recommended)

    ``options`` are the other fields of ``UserCompareConfig``: ``scheduler`` (optimizer
    -> LR scheduler), ``seed``, ``eval_interval``, ``train_loss_window``, ``device``,
    ``recipe``, ``threshold_percent`` (default 0.5) and ``name``.

    On the built-in models, ``config`` (default: ``CompareConfig()``, a few minutes on a
    laptop CPU) says what to train; ``steps``, ``levels``, ``seeds``, ``model`` (a
    ``GPTConfig`` or ``LlamaSpec``) and ``options`` (other ``CompareConfig`` fields)
    override its fields.

    Args:
        config: the built-in comparison's configuration (or a ``UserCompareConfig``,
            your own model's, whole); not with ``data=``.
        model, data, optimizer, loss, eval_data, steps, levels, seeds: your own model's
            comparison (see ``UserCompareConfig``); ``model`` and ``data`` select it.
        out_dir: folder for ``compare.json`` and ``loss_curves.png``; None writes nothing.
        console: a rich console to print to (default: stdout).
        progress: show a rich progress bar while training.
        plot: save the PNG of the loss curves when matplotlib is installed; without it,
            print how to get it.

    Returns:
        a ``CompareResult`` with every curve and figure, and ``recommended``: the level
        to use and why.

    Raises:
        TypeError: ``config`` is not a ``CompareConfig``; arguments of the two forms
            mixed; an unknown option; a model, data, optimizer or loss of the wrong kind.
        ValueError: ``out_dir`` cannot be created, or a value the configuration refuses
            (before any training); data or a loss O0 cannot train on.
        RuntimeError: your model failed at O0 (it does not train as it is).
    """
    if isinstance(config, UserCompareConfig):  # your own model's comparison, configured already
        if model is not None or data is not None or options:
            raise TypeError("compare takes a UserCompareConfig alone; put model, data and options in it")
        return compare_model(config, out_dir=out_dir, console=console, progress=progress, plot=plot)
    builtin_model = isinstance(model, (GPTConfig, LlamaSpec))
    if data is not None or (model is not None and not builtin_model):
        if config is not None:
            raise TypeError("compare takes either a CompareConfig (the built-in models) or model= and data= "
                            "(your own), not both")
        if model is None or data is None:
            raise TypeError("compare on your own model needs both model= (a module or a function that builds "
                            "one) and data= (the training batches)")
        user = {"levels": levels, "seeds": seeds, "optimizer": optimizer, "loss": loss, "eval_data": eval_data}
        try:
            user_config = UserCompareConfig(model=model, data=data, steps=steps, **{
                key: value for key, value in user.items() if value is not None}, **options)
        except TypeError as error:
            unknown = set(options) - {field.name for field in dataclasses.fields(UserCompareConfig)}
            if not unknown:
                raise
            raise TypeError(f"compare got unknown option(s) {', '.join(sorted(unknown))}; the options are "
                            f"{', '.join(field.name for field in dataclasses.fields(UserCompareConfig))}") from error
        return compare_model(user_config, out_dir=out_dir, console=console, progress=progress, plot=plot)
    user_only = {"optimizer": optimizer, "loss": loss, "eval_data": eval_data}
    given = [name for name, value in user_only.items() if value is not None]
    if given:
        raise TypeError(f"compare got {', '.join(given)} without data=: they go with your own model; pass "
                        "model= and data= too (or leave them out for the built-in models)")
    if config is not None and not isinstance(config, CompareConfig):
        hint = ("; to compare your own model pass it by name: amp8.compare(model=..., data=...)"
                if isinstance(config, torch.nn.Module) or callable(config) else "")
        raise TypeError(f"compare takes an amp8.tools.experiments.compare.CompareConfig, got "
                        f"{type(config).__name__}{hint}")
    config = CompareConfig() if config is None else config
    changes = {key: value for key, value in (("model", model), ("steps", steps), ("seeds", seeds)) if value is not None}
    if levels is not None:
        changes["levels"] = tuple(levels)
    if changes or options:
        config = config.replace(**changes, **options)
    return compare_builtin(config, out_dir=out_dir, console=console, progress=progress, plot=plot)


def compare_builtin(
    config: CompareConfig,
    *,
    out_dir: str | Path | None = DEFAULT_OUT,
    console: Any = None,
    progress: bool = True,
    plot: bool = True,
) -> CompareResult:
    """Train every run ``config`` asks for on the built-in model and corpus, print the
    table, and save the results (see ``compare``).

    Raises:
        ValueError: ``out_dir`` cannot be created (before any training).
    """
    check_out_dir(out_dir)
    console = console or default_console()
    corpus = load_corpus(config.corpus)
    device = torch.device(config.device)
    val_batches = validation_batches(config, corpus)
    specs = run_specs(config)
    note = missing_peer_note(config)
    if note is not None:
        console.print(note, highlight=False)
    runs: list[RunResult] = []
    with progress_bar(console, progress) as bar:
        task = bar.add_task("amp8 compare", total=len(specs) * config.steps, loss="-")
        for index, spec in enumerate(specs):
            seed = f" (seed {spec.seed})" if config.seeds > 1 else ""
            bar.update(task, description=f"[{index + 1}/{len(specs)}] {spec.name}{seed}")

            def on_step(step: int, loss: float) -> None:
                bar.update(task, advance=1, loss=f"{loss:.3f}")

            try:
                result = train_run(spec, config, corpus, val_batches, on_step)
            except Exception as error:  # a peer library's failure must not lose amp8's runs
                if not spec.torchao:
                    raise
                result = RunResult(spec.name, spec.level, spec.seed, status="unavailable",
                                   reason=f"torchao float8 training failed: {type(error).__name__}: {error}")
            if not result.ok:
                bar.update(task, advance=config.steps)
            runs.append(result)
    result = CompareResult(config, runs, corpus.describe(), environment(device))
    finish(result, out_dir, console, plot)
    return result


def load_report(path: str | Path, run: str = "O1") -> PrecisionReport:
    """The precision report of the final model of run ``run`` in a ``compare.json``
    (``path`` is the file or its folder): of the first seed it trained from, when the
    comparison ran several.

    Raises:
        FileNotFoundError: when there is no compare.json there, saying how to make one.
        ValueError: a file that is not a compare.json.
        KeyError: for a run that is not in the file, or that did not train, naming those that did.
    """
    path = Path(path)
    if path.is_file() or path.suffix == ".json":
        folder = path.parent
    else:  # a folder, as ``amp8 compare --out`` takes it
        folder, path = path, path / JSON_NAME
    if not path.is_file():
        hint = "amp8 compare" if folder == Path(DEFAULT_OUT) else f"amp8 compare --out {folder}"
        raise FileNotFoundError(f"{path} does not exist; run `{hint}` first")
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not the compare.json `amp8 compare` writes") from None
    trained: dict[str, Any] = {}
    for r in runs:
        if r["status"] == "ok":
            trained.setdefault(r["name"], r)  # the first seed's
    if run not in trained:
        raise KeyError(
            f"run {run!r} has no trained model in {path}; choose one of {', '.join(trained)}"
        )
    return PrecisionReport.from_dict(trained[run]["report"])
