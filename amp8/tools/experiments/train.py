"""One run of the experiments: train a model at an opt level (or under torchao's float8)
from a seed, on the corpus's batches, and measure it.

``train_run`` builds the model from its seed, applies ``amp8.initialize`` (or torchao),
trains with AdamW under the configuration's learning-rate schedule and returns a
``RunResult``: loss curves, speed, memory and the final model's precision report.
``compare`` and ``paired_runs`` are made of such runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import OptLevel
from amp8.config.recipe import Recipe
from amp8.frontend import initialize
from amp8.monitor.controller import Controller
from amp8.monitor.report import report
from amp8.nn import Fp8Linear
from amp8.nn.memory import count_saved_bytes
from amp8.quant.scale_layout import GEMM_ALIGNMENT
from amp8.tools.experiments.compare_config import _VAL_SEED, CompareConfig, RunSpec
from amp8.tools.experiments.corpus import ByteCorpus, sample_batch
from amp8.tools.experiments.stress import OutlierInjection, mask_position


@dataclass
class RunResult:
    """What one run measured. ``status`` is "ok", "unavailable" (a level this build cannot
    train) or "failed" (the run raised; runs of the user's own model only), and then
    ``reason`` says why.

    Losses are mean cross-entropy in nats per byte (the user's loss for their own model). ``train_curve`` holds one loss per
    step; ``val_curve`` holds ``[step, loss]`` pairs. ``peak_memory_bytes`` is measured on
    CUDA only (None elsewhere). ``activation_bytes_per_token`` is what autograd saved for
    backward in the first step's forward (``amp8.count_saved_bytes``), per token.
    ``report`` is the precision report of the final model. A run with a controller
    records its moves (``controller_moves``, as dicts) and the share of the FP8 layers'
    GEMM FLOPs still in FP8 at the end (``gemm_fp8_share``) and, per layer, the largest
    shares flushed and clipped it saw (``controller_peaks``).

    Runs of the user's own model (``amp8.compare(model=..., data=...)``) also record
    ``samples_per_s`` and ``activation_bytes_per_sample`` (``tokens_per_s`` and
    ``activation_bytes_per_token`` too when batches hold ``input_ids``), ``train_s`` (the
    time inside training steps), ``report_summary`` (the precision report's one line)
    and ``batches_differ_at``: the first step whose batch differed from the batch O0 of
    the same seed saw (None when all were alike, or for O0 itself).
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
    samples_per_s: float | None = None
    activation_bytes_per_sample: float | None = None
    train_s: float | None = None
    report_summary: str | None = None
    batches_differ_at: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the run trained."""
        return self.status == "ok"


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
        return (isinstance(module, nn.Linear) and module.in_features % GEMM_ALIGNMENT == 0
                and module.out_features % GEMM_ALIGNMENT == 0 and id(module.weight) not in embedding_weights)

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def warmup_cosine_lr(step: int, peak: float, warmup: int, steps: int, floor_ratio: float) -> float:
    """The learning rate of step ``step`` (0-based) of ``steps``: a linear warm-up over
    ``warmup`` steps to ``peak``, then a cosine decay to ``floor_ratio * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode (restores train mode), without
    autograd."""
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
    fp8 = not spec.torchao and level_name != "O0"
    result = RunResult(spec.name, level_name, spec.seed,
                       recipe=_recipe_dict(spec.recipe) if fp8 and spec.recipe is not None else None)
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
    if fp8 and result.recipe is None:  # initialize's default: record the one its layers hold
        result.recipe = next((_recipe_dict(m.recipe) for m in model.modules() if isinstance(m, Fp8Linear)), None)
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
    """``recipe`` as plain data (enums by value), for JSON."""
    return {key: getattr(value, "value", value) for key, value in dataclasses.asdict(recipe).items()}
