"""``amp8.compare``: train the same GPT from the same seed at every opt level and compare.

Every run builds the byte-level GPT from the same seed, draws the same batches from the
standard-library corpus, and trains with AdamW under the same learning-rate schedule; only
the opt level (or recipe) differs. Runs:

- ``O0`` ... ``O3``: the levels of ``amp8.LEVELS`` that were asked for. A level that
  ``amp8.initialize`` refuses with ``NotImplementedError`` is recorded as unavailable;
- ``O1-noscale``: O1 with ``Recipe(scaling="none")``, FP8 casts without scales, an
  ablation that shows why scaling matters;
- ``torchao``: torchao's float8 training on the same model, when torchao is importable;
- ``O0-seed<k>``: O0 again from other seeds (``seeds > 1``), to measure seed-to-seed spread.

The results hold every loss curve and figure; ``write_json`` and ``plot`` save them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..console import default_console
from ..frontend import initialize
from ..levels import LEVELS, OptLevel
from ..memory import count_saved_bytes
from ..recipe import ActivationFormat, Recipe
from ..report import PrecisionReport, report
from .corpus import ByteCorpus, CorpusConfig, load_corpus, sample_batch
from .gpt import GPT, PRESETS, GPTConfig

ABLATION = "O1-noscale"
TORCHAO = "torchao"
JSON_NAME = "compare.json"
DEFAULT_OUT = "runs/compare"
PNG_NAME = "loss_curves.png"
_VAL_SEED = 1234  # the validation windows are the same for every run and seed


@dataclass(frozen=True)
class CompareConfig:
    """What ``compare`` trains and how.

    Attributes:
        model: the GPT's shape (see ``amp8.experiments.gpt.PRESETS``).
        steps: optimizer steps per run.
        batch_size: sequences per step.
        lr: peak learning rate (linear warm-up, cosine decay to ``lr * min_lr_ratio``).
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        warmup_steps: steps of linear warm-up.
        weight_decay: AdamW decay of matrices (biases, norms and positions are not decayed).
        levels: opt levels to train, names from ``amp8.LEVELS``; must include "O0".
        ablation: also train O1 with ``Recipe(scaling="none")``.
        torchao: also train torchao's float8 when torchao is importable.
        seeds: runs of O0 from seeds ``seed, seed + 1, ...`` (the others use ``seed``).
        seed: the seed of the model's initial weights and of the batch order.
        eval_interval: steps between validation-loss evaluations on the curve.
        eval_batches: batches of the fixed validation set.
        train_loss_window: the final train loss is the mean of this many last steps.
        device: "cpu" or "cuda" (any torch device string).
        corpus: which bytes to train on.
        recipe: the FP8 recipe of the O1-O3 runs (the ablation takes it with no scaling;
            O0 ignores it, FP8 activations included).
    """

    model: GPTConfig = PRESETS["small"]
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    levels: tuple[str, ...] = tuple(LEVELS)
    ablation: bool = True
    torchao: bool = True
    seeds: int = 1
    seed: int = 0
    eval_interval: int = 50
    eval_batches: int = 16
    train_loss_window: int = 20
    device: str = "cpu"
    corpus: CorpusConfig = CorpusConfig()
    recipe: Recipe = Recipe()

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        for name in ("steps", "batch_size", "seeds", "eval_interval", "eval_batches", "train_loss_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CompareConfig.{name}={value!r} is not valid; use an int >= 1")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"CompareConfig.warmup_steps={self.warmup_steps!r} is not valid; use an int >= 0")
        if not 0 < self.lr < math.inf or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"CompareConfig lr={self.lr}, min_lr_ratio={self.min_lr_ratio} are not valid; "
                "use a finite lr > 0 and 0 <= min_lr_ratio <= 1"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"CompareConfig.weight_decay={self.weight_decay!r} is not valid; use a finite float >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"CompareConfig.seed={self.seed!r} is not valid; use an int in [0, 2**63)")
        for name, kind in (("model", GPTConfig), ("corpus", CorpusConfig), ("recipe", Recipe)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"CompareConfig.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        _check_device(self.device)
        unknown = [level for level in self.levels if level not in LEVELS]
        if unknown:
            raise ValueError(
                f"CompareConfig.levels has {', '.join(map(repr, unknown))}, not amp8 opt levels; "
                f"use names from {', '.join(map(repr, LEVELS))}"
            )
        if "O0" not in self.levels:
            raise ValueError(
                f"CompareConfig.levels={self.levels} lacks 'O0'; every gap is measured against O0, "
                "so include it"
            )

    def replace(self, **changes: Any) -> "CompareConfig":
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        warmup = min(self.warmup_steps, self.steps // 5)  # short runs keep most steps for decay
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - 1 - warmup)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


def _check_device(device: object) -> None:
    """Raise ``ValueError`` unless ``device`` names a torch device this machine has."""
    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ValueError(
            f"CompareConfig.device={device!r} is not a torch device; use e.g. 'cpu' or 'cuda'"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"CompareConfig.device={device!r} is not available: this torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use 'cpu'"
        )


@dataclass(frozen=True)
class RunSpec:
    """One run: its name, opt level (a name, or an ``OptLevel`` such as
    ``amp8.levels.override("O2", exp_avg="fp32")``), recipe and seed, or torchao's float8."""

    name: str
    level: str | OptLevel
    seed: int
    recipe: Recipe = Recipe()
    torchao: bool = False


@dataclass
class RunResult:
    """What one run measured. ``status`` is "ok" or "unavailable" (then ``reason`` says why).

    Losses are mean cross-entropy in nats per byte. ``train_curve`` holds one loss per
    step; ``val_curve`` holds ``[step, loss]`` pairs. ``peak_memory_bytes`` is measured on
    CUDA only (None elsewhere). ``activation_bytes_per_token`` is what autograd saved for
    backward in the first step's forward (``amp8.count_saved_bytes``), per token.
    ``report`` is the precision report of the final model.
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
        return (f"GPT {m.n_layer}x{m.n_embd} (ctx {m.block_size}), {c.steps} steps x "
                f"{c.batch_size} seqs, {c.device}{recipe}")

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


def run_specs(config: CompareConfig) -> list[RunSpec]:
    """The runs ``config`` asks for, in the order they train. O0 is the baseline as the
    model is: it keeps its activations as they are whatever the recipe says."""
    baseline = config.recipe.replace(activations=ActivationFormat.HIGH)
    specs = [RunSpec(level, level, config.seed, baseline if level == "O0" else config.recipe)
             for level in config.levels]
    if config.ablation:
        specs.append(RunSpec(ABLATION, "O1", config.seed, config.recipe.replace(scaling="none")))
    if config.torchao and torchao_available():
        specs.append(RunSpec(TORCHAO, "O0", config.seed, torchao=True))
    specs += [RunSpec(f"O0-seed{config.seed + k}", "O0", config.seed + k) for k in range(1, config.seeds)]
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


def _to_torchao(model: nn.Module) -> nn.Module:
    """torchao's float8 training on the FP8-eligible Linear layers (not the tied head)."""
    from torchao.float8 import convert_to_float8_training

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
                and module.out_features % 16 == 0 and fqn != "head")

    return convert_to_float8_training(model, module_filter_fn=eligible)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode (restores train mode)."""
    model.eval()
    total = sum(float(model(x, y)[1]) for x, y in batches)
    model.train()
    return total / len(batches)


def train_run(
    spec: RunSpec,
    config: CompareConfig,
    corpus: ByteCorpus,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    on_step: Callable[[int, float], None] | None = None,
) -> RunResult:
    """Train one run and measure it; an opt level ``initialize`` cannot do yet (it raises
    ``NotImplementedError``) comes back as ``status="unavailable"``."""
    device = torch.device(config.device)
    level_name = spec.level.name if isinstance(spec.level, OptLevel) else spec.level
    result = RunResult(spec.name, level_name, spec.seed,
                       recipe=None if spec.torchao or level_name == "O0" else _recipe_dict(spec.recipe))
    model: nn.Module = GPT(config.model, torch.Generator().manual_seed(spec.seed)).to(device)
    optimizer: torch.optim.Optimizer | None = torch.optim.AdamW(
        _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.95)
    )
    try:
        if spec.torchao:
            model = _to_torchao(model)
        else:
            # Every eligible layer, on every device: the comparison is of FP8 against
            # high precision, not of the speed rule's choice.
            model, optimizer = initialize(model, optimizer, spec.level, recipe=spec.recipe, layer_selection="all")
    except (NotImplementedError, ImportError, RuntimeError) as error:
        result.status, result.reason = "unavailable", str(error)
        return result
    assert optimizer is not None  # initialize returns the optimizer it was given
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(spec.seed)
    train_time = 0.0
    start = time.perf_counter()
    model.train()
    for step in range(config.steps):
        x, y = (t.to(device) for t in sample_batch(corpus.train, config.batch_size, config.model.block_size, generator))
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
    return result


def validation_batches(config: CompareConfig, corpus: ByteCorpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches every run of ``config`` is measured on (the same for
    every run and seed), on ``config.device``."""
    generator = torch.Generator().manual_seed(_VAL_SEED)
    device = torch.device(config.device)
    return [
        tuple(t.to(device) for t in sample_batch(corpus.val, config.batch_size, config.model.block_size, generator))
        for _ in range(config.eval_batches)
    ]


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
