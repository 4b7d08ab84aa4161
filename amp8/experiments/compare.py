"""``amp8.compare``: train the same GPT from the same seed at every opt level and compare.

Every run builds the byte-level GPT from the same seed, draws the same batches from the
standard-library corpus, and trains with AdamW under the same learning-rate schedule; only
the opt level (or recipe) differs. Runs:

- ``O0`` ... ``O3``: the levels of ``amp8.LEVELS`` that were asked for. A level that
  ``amp8.initialize`` refuses with ``NotImplementedError`` is recorded as unavailable;
- ``O1-noscale``: O1 with ``Recipe(scaling="none")``, FP8 casts without scales, an
  ablation that shows why scaling matters; under a microscaled recipe instead one O1 run
  without each of its knobs that is on (``O1-no-hadamard``, ``O1-no-sr``);
- ``torchao``, ``torchao-rowwise``: torchao's float8 training on the same model under its
  tensorwise and rowwise recipes, when torchao is importable;
- ``O0-seed<k>``: O0 again from other seeds (``seeds > 1``), to measure seed-to-seed spread;
- ``<level>+controller``: a level of ``controller_levels`` again with an
  ``amp8.Controller``, which records its moves and the share of GEMM FLOPs left in FP8.

With ``CompareConfig.stress`` set, every run (O0 included) trains under the same outlier
injection (``amp8.experiments.stress``) and its position is left out of the training and
validation loss.

The results hold every loss curve and figure; ``write_json`` and ``plot`` save them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..console import default_console
from ..controller import Controller
from ..frontend import initialize
from ..levels import OptLevel
from ..memory import count_saved_bytes
from ..recipe import ActivationFormat, Microscaling, Recipe
from ..report import PrecisionReport, report
from .corpus import ByteCorpus, load_corpus, sample_batch
from .gpt import GPT
from .stress import OutlierInjection, mask_position
from .compare_config import (  # noqa: F401  (the public names of amp8.experiments.compare)
    ABLATION, DEFAULT_OUT, JSON_NAME, KNOB_ABLATIONS, PNG_NAME, TORCHAO, TORCHAO_RUNS, _VAL_SEED, CompareConfig,
    RunSpec,
)
from .compare_result import CompareResult, RunResult  # noqa: F401


def run_specs(config: CompareConfig) -> list[RunSpec]:
    """The runs ``config`` asks for, in the order they train. O0 is the baseline as the
    model is: it keeps its activations as they are whatever the recipe says."""
    baseline = config.recipe.replace(activations=ActivationFormat.HIGH)
    specs = [RunSpec(level, level, config.seed, baseline if level == "O0" else config.recipe)
             for level in config.levels]
    if config.ablation and config.recipe.microscaling is Microscaling.NONE:
        specs.append(RunSpec(ABLATION, "O1", config.seed, config.recipe.replace(scaling="none")))
    elif config.ablation:  # microscaled formats fix their scaling: ablate the knobs instead
        specs += [RunSpec(name, "O1", config.seed, config.recipe.replace(**{knob: False}))
                  for knob, name in KNOB_ABLATIONS.items() if getattr(config.recipe, knob)]
    if config.torchao and torchao_available():
        specs += [RunSpec(name, "O0", config.seed, torchao=True, torchao_recipe=recipe)
                  for recipe, name in TORCHAO_RUNS.items()]
    specs += [RunSpec(f"O0-seed{config.seed + k}", "O0", config.seed + k) for k in range(1, config.seeds)]
    specs += [RunSpec(f"{level}+controller", level, config.seed, config.recipe, controller=config.controller)
              for level in config.controller_levels]
    return specs


def missing_peer_note(config: CompareConfig) -> str | None:
    """The line that says torchao's float8 peer is left out because torchao is not
    installed (None when it runs, or when ``config`` does not ask for it)."""
    if not config.torchao or torchao_available():
        return None
    return ("torchao is not installed: its float8 training is left out of the comparison "
            "(pip install torchao to add it, --no-torchao to silence this)")


def torchao_available() -> bool:
    """Whether torchao can be imported."""
    return importlib.util.find_spec("torchao") is not None


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only, as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _to_torchao(model: nn.Module, recipe: str) -> nn.Module:
    """torchao's float8 training under its recipe ``recipe`` ("tensorwise" or "rowwise")
    on the Linear layers whose dims are multiples of 16, as torchao converts them, except a
    head tied to an embedding (its weight is the embedding's)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0 and id(module.weight) not in embedding_weights)

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=eligible)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode (restores train mode)."""
    model.eval()
    total = sum(float(model(x, y)[1]) for x, y in batches)
    model.train()
    return total / len(batches)


_PERTURBATION_SEED = 1234


@torch.no_grad()
def _perturb(model: nn.Module, relative: float) -> None:
    """Multiply every parameter by ``1 + relative * N(0, 1)``, elementwise."""
    generator = torch.Generator().manual_seed(_PERTURBATION_SEED)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=generator).to(param.device)
        param.mul_(1 + relative * noise)


def train_run(
    spec: RunSpec,
    config: CompareConfig,
    corpus: ByteCorpus,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    on_step: Callable[[int, float], None] | None = None,
    on_model: Callable[[nn.Module], None] | None = None,
) -> RunResult:
    """Train one run and measure it; an opt level ``initialize`` cannot do yet (it raises
    ``NotImplementedError``) comes back as ``status="unavailable"``.

    ``on_step(step, loss)`` is called after each step; ``on_model(model)`` once, with the
    model as it will train (after ``initialize`` and the stress injection), before the
    first step, e.g. to register hooks that measure it. With ``config.stress``, the
    outlier is injected (``OutlierInjection``) and its position's targets are ignored;
    ``val_batches`` should come from ``validation_batches``, which masks them too."""
    device = torch.device(config.device)
    level_name = spec.level.name if isinstance(spec.level, OptLevel) else spec.level
    result = RunResult(spec.name, level_name, spec.seed,
                       recipe=None if spec.torchao or level_name == "O0" else _recipe_dict(spec.recipe))
    model: nn.Module = config.model.build(torch.Generator().manual_seed(spec.seed)).to(device)
    controller = None
    if spec.init_perturbation:
        _perturb(model, spec.init_perturbation)
    optimizer: torch.optim.Optimizer | None = torch.optim.AdamW(
        _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95)
    )
    try:
        if spec.torchao:
            model = _to_torchao(model, spec.torchao_recipe)
        else:
            # Every eligible layer, on every device: the comparison is of FP8 against
            # high precision, not of the speed rule's choice.
            controller = None if spec.controller is None else Controller(spec.controller)
            model, optimizer = initialize(model, optimizer, spec.level, recipe=spec.recipe, layer_selection="all",
                                          controller=controller)
    except (NotImplementedError, ImportError, RuntimeError) as error:
        result.status, result.reason = "unavailable", str(error)
        return result
    assert optimizer is not None  # initialize returns the optimizer it was given
    injection = None
    if config.stress is not None:  # after the swap: the hook goes on the module that runs
        injection = OutlierInjection(config.stress, config.steps)
        injection.attach(model)
    if on_model is not None:
        on_model(model)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(spec.seed)
    train_time = 0.0
    start = time.perf_counter()
    model.train()
    for step in range(config.steps):
        x, y = (t.to(device) for t in sample_batch(corpus.train, config.batch_size, config.model.block_size, generator))
        if injection is not None:
            injection.step = step
            y = mask_position(y, injection.stress.position)
        if cuda:
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.zero_grad()
        with count_saved_bytes(model) if step == 0 else contextlib.nullcontext() as saved:
            _, loss = model(x, y)
        if saved is not None:
            result.activation_bytes_per_token = saved.per_token(x.numel())
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())  # also synchronizes
        train_time += time.perf_counter() - tic
        result.train_curve.append(loss_value)
        if (step + 1) % config.eval_interval == 0 or step + 1 == config.steps:
            result.val_curve.append([step + 1, evaluate(model, val_batches)])
        if on_step is not None:
            on_step(step, loss_value)
    result.wall_s = time.perf_counter() - start
    result.final_train_loss = sum(result.train_curve[-config.train_loss_window:]) / min(
        config.train_loss_window, len(result.train_curve))
    result.final_val_loss = result.val_curve[-1][1]
    result.tokens_per_s = config.steps * config.batch_size * config.model.block_size / train_time
    result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    precision = report(model, optimizer, result.activation_bytes_per_token)
    result.bytes_per_param = precision.bytes_per_param
    result.fp8_share = precision.fp8_share
    result.skipped_steps = getattr(optimizer, "skipped_steps", None)
    result.highlights = precision.highlights()
    result.report = precision.to_dict()
    if controller is not None:
        result.controller_moves = [dataclasses.asdict(move) for move in controller.moves]
        result.gemm_fp8_share = controller.fp8_share()
        result.controller_peaks = controller.peak_signals()
    return result


def validation_batches(config: CompareConfig, corpus: ByteCorpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches every run of ``config`` is measured on (the same for
    every run and seed), on ``config.device``; under ``config.stress`` the stressed
    position's targets are ignored."""
    generator = torch.Generator().manual_seed(_VAL_SEED)
    device = torch.device(config.device)
    batches = []
    for _ in range(config.eval_batches):
        x, y = sample_batch(corpus.val, config.batch_size, config.model.block_size, generator)
        if config.stress is not None:
            y = mask_position(y, config.stress.position)
        batches.append((x.to(device), y.to(device)))
    return batches


def _recipe_dict(recipe: Recipe) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in dataclasses.asdict(recipe).items()}


def compare(
    config: CompareConfig | None = None,
    *,
    out_dir: str | Path | None = DEFAULT_OUT,
    console: Any = None,
    progress: bool = True,
    plot: bool = True,
) -> CompareResult:
    """Train every run ``config`` asks for, print the table, and save the results.

    Args:
        config: what to train (default: ``CompareConfig()``, a few minutes on a laptop CPU).
        out_dir: folder for ``compare.json`` and ``loss_curves.png``; None writes nothing.
        console: a rich console to print to (default: stdout).
        progress: show a rich progress bar while training.
        plot: save the PNG of the loss curves when matplotlib is installed; without it,
            print how to get it.

    Returns:
        a ``CompareResult`` with every curve and figure.

    Raises:
        TypeError: ``config`` is not a ``CompareConfig``.
        ValueError: ``out_dir`` cannot be created (before any training).
    """
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    config = CompareConfig() if config is None else config
    if not isinstance(config, CompareConfig):
        raise TypeError(f"compare takes an amp8.experiments.compare.CompareConfig, got {type(config).__name__}")
    if out_dir is not None:  # a folder that cannot be written fails now, not after training
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"out_dir={str(out_dir)!r} cannot be created ({error.strerror}); pick a folder you can write") from None
    console = console or default_console()
    corpus = load_corpus(config.corpus)
    device = torch.device(config.device)
    val_batches = validation_batches(config, corpus)
    specs = run_specs(config)
    note = missing_peer_note(config)
    if note is not None:
        console.print(note, highlight=False)
    runs: list[RunResult] = []
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                   console=console, disable=not progress)
    with bar:
        task = bar.add_task("amp8 compare", total=len(specs) * config.steps, loss="-")
        for index, spec in enumerate(specs):
            bar.update(task, description=f"[{index + 1}/{len(specs)}] {spec.name}")

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
    environment = {
        "amp8": _amp8_version(), "torch": torch.__version__, "python": platform.python_version(),
        "device": str(device), "threads": torch.get_num_threads(),
        "torchao": torchao_available(),
    }
    result = CompareResult(config, runs, corpus.describe(), environment)
    result.print(console)
    if out_dir is not None:
        out = Path(out_dir)
        console.print(f"wrote {result.write_json(out / JSON_NAME)}", highlight=False)
        if plot:
            try:
                console.print(f"wrote {result.plot(out / PNG_NAME)}", highlight=False)
            except ModuleNotFoundError as error:
                console.print(f"no plot: {error}", highlight=False, markup=False)
    return result


def _amp8_version() -> str:
    from .. import __version__

    return __version__


def load_report(path: str | Path, run: str = "O1") -> PrecisionReport:
    """The precision report of the final model of run ``run`` in a ``compare.json``
    (``path`` is the file or its folder).

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
    trained = {r["name"]: r for r in runs if r["status"] == "ok"}
    if run not in trained:
        raise KeyError(
            f"run {run!r} has no trained model in {path}; choose one of {', '.join(trained)}"
        )
    return PrecisionReport.from_dict(trained[run]["report"])
