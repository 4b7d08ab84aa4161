"""Token outliers at a chosen share of the tokens: a token-wise MLP regressed on a teacher.

The model is a stack of ``nn.Linear`` layers with GELU between them, applied to each token
on its own; the loss is the mean squared error against a fixed teacher of the same shape,
over the tokens that are not outliers. A ``TokenStress`` multiplies every
``1 / share``-th token row of one layer's input by a gain that ramps from 1 to
``2 ** log2_gain``: that layer and every later one see the outlier rows (the GELU keeps
them huge). In exact arithmetic nothing changes, since a token reaches only its own
output, which the loss leaves out, and its gradient is zero; in FP8 the outlier rows set
the scales that run along tokens (wgrad's, and every scale under one per tensor), so
every gap to the unstressed run is FP8's.

``studies/stress_tokens.py`` runs the study (outliers at 1/64, 1/16 and 1/4 of the tokens,
in one layer or in most, rowwise and tensorwise starts); ``tests/monitor`` trains a small
one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import amp8
from amp8.config.controller import ControllerConfig
from amp8.config.recipe import Recipe
from amp8.tools.experiments.train import warmup_cosine_lr

IGNORED_SHARE = 0.25
"""The loss leaves out every fourth token in every run, stressed or not, so all runs
measure the same loss; the outliers of every ``TokenStress`` (a period that is a multiple
of 4: 1/4, 1/16, 1/64) are among those tokens."""


@dataclass(frozen=True)
class TokenSetup:
    """The training run: model widths, batches and the learning-rate schedule.

    Attributes:
        widths: the Linears' feature counts, input first: ``len(widths) - 1`` layers.
        tokens: tokens a sequence.
        batch_size: sequences a batch.
        steps: optimizer steps.
        lr: AdamW's peak learning rate (linear warm-up, then cosine decay to 10 %).
        warmup: warm-up steps.
        eval_batches: held-out batches of the final validation loss.
    """

    widths: tuple[int, ...] = (256, 512, 512, 512, 256)
    tokens: int = 32
    batch_size: int = 16
    steps: int = 300
    lr: float = 1e-3
    warmup: int = 20
    eval_batches: int = 4

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        return warmup_cosine_lr(step, self.lr, self.warmup, self.steps, 0.1)


@dataclass(frozen=True)
class TokenStress:
    """Which tokens are outliers, where they enter and how they grow.

    Attributes:
        share: the share of tokens that are outliers: every ``round(1 / share)``-th
            token of the flattened batch (so 1/64 of 32-token sequences is position 0
            of every other sequence); a period that is a multiple of 4, so the
            outliers are among the tokens the loss leaves out (``IGNORED_SHARE``).
        layer: the index of the Linear whose input is scaled; it and every later
            Linear see the outliers.
        log2_gain: the final gain is ``2 ** log2_gain``.
        ramp_fraction: the share of the steps over which ``log2(gain)`` grows from 0.
    """

    share: float = 1 / 16
    layer: int = 1
    log2_gain: float = 20.0
    ramp_fraction: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) \
                or not 0 < self.share <= IGNORED_SHARE:
            raise ValueError(f"TokenStress.share={self.share!r} is not valid; use a share of tokens in "
                             f"(0, {IGNORED_SHARE:g}]")
        if round(1 / self.share) % round(1 / IGNORED_SHARE):
            raise ValueError(f"TokenStress.share={self.share!r} is not valid; use 1/4, 1/8, 1/16, ... (the loss "
                             "leaves out every fourth token, and the outliers must be among them)")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"TokenStress.layer={self.layer!r} is not valid; use a Linear's index >= 0")

    @property
    def period(self) -> int:
        """One token in ``period`` is an outlier."""
        return round(1 / self.share)

    def gain(self, step: int, steps: int) -> float:
        """The factor on the outlier rows at step ``step`` of ``steps``."""
        ramp = self.ramp_fraction * steps
        return 2.0 ** (self.log2_gain * (1.0 if ramp <= 0 else min(1.0, step / ramp)))

    def outlier_rows(self, batch_size: int, tokens: int) -> torch.Tensor:
        """(batch_size, tokens) bool: the outlier tokens."""
        return (torch.arange(batch_size * tokens) % self.period == 0).view(batch_size, tokens)


def token_mlp(widths: tuple[int, ...]) -> nn.Sequential:
    """Linears of ``widths`` with GELU between them (none after the last)."""
    layers: list[nn.Module] = []
    for index, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        if index:
            layers.append(nn.GELU())
        layers.append(nn.Linear(k, n))
    return nn.Sequential(*layers)


def linears(model: nn.Module) -> list[nn.Module]:
    """The model's Linear positions, in order (``nn.Linear`` or what replaced it)."""
    return [module for module in model if not isinstance(module, nn.GELU)]  # type: ignore[union-attr]


class _Injection:
    """A forward pre-hook that multiplies the outlier rows by the current gain."""

    def __init__(self, stress: TokenStress, steps: int) -> None:
        self.stress, self.steps, self.step = stress, steps, 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]  # (B, T, K)
        rows = self.stress.outlier_rows(x.shape[0], x.shape[1]).to(x.device)
        factor = torch.where(rows, self.stress.gain(self.step, self.steps), 1.0).to(x.dtype)
        return (x * factor[..., None], *args[1:])


def _batch(setup: TokenSetup, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(setup.batch_size, setup.tokens, setup.widths[0], generator=generator)


@dataclass(frozen=True)
class TokenRun:
    """One run: opt level (``"O0"`` leaves the model as it is), recipe (None: the
    level's default), controller settings (None: none), stress (None: unstressed)."""

    level: str
    recipe: Recipe | None = None
    controller: ControllerConfig | None = None
    stress: TokenStress | None = None


TEACHER_SEED = 1234
VAL_SEED = 4321


def train(run: TokenRun, seed: int, setup: TokenSetup = TokenSetup()) -> dict[str, Any]:
    """Train ``run`` from ``seed`` (the student's weights and the batch order); return
    the final validation loss (mean squared error over the tokens that are not
    outliers, on held-out batches under the same stress), and for a controlled run its
    moves and the share of GEMM FLOPs left in FP8."""
    torch.manual_seed(TEACHER_SEED)
    teacher = token_mlp(setup.widths)
    torch.manual_seed(seed)
    model = token_mlp(setup.widths)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    controller = None if run.controller is None else amp8.Controller(run.controller)
    if run.level != "O0":
        model, optimizer = amp8.initialize(model, optimizer, run.level, recipe=run.recipe, controller=controller)
    injection = None
    if run.stress is not None:
        injection = _Injection(run.stress, setup.steps)
        for layer in linears(model)[run.stress.layer:][:1]:
            layer.register_forward_pre_hook(injection)
    kept = ~TokenStress(share=IGNORED_SHARE).outlier_rows(setup.batch_size, setup.tokens)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = teacher(x)
        return F.mse_loss(model(x)[kept], target[kept])

    generator = torch.Generator().manual_seed(seed)
    for step in range(setup.steps):
        if injection is not None:
            injection.step = step
        for group in optimizer.param_groups:
            group["lr"] = setup.lr_at(step)
        optimizer.zero_grad()
        loss_of(_batch(setup, generator)).backward()
        optimizer.step()
    validation = torch.Generator().manual_seed(VAL_SEED)
    model.eval()
    with torch.no_grad():
        val = sum(float(loss_of(_batch(setup, validation))) for _ in range(setup.eval_batches)) / setup.eval_batches
    record: dict[str, Any] = {"final_val_loss": val}
    if controller is not None:
        record["moves"] = [dataclasses.asdict(move) for move in controller.moves]
        record["gemm_fp8_share"] = controller.fp8_share()
        record["rungs"] = controller.rungs()
    return record
