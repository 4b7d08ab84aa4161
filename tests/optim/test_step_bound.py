"""Adam's bound on one step (``amp8.optim.bound``): exact Adam reaches it and never
passes it, and a step over low-bit moments is held to it, at every level and recipe, when
one token's activations are a thousand times the others'."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amp8
from amp8.optim import LowBitAdam
from amp8.optim import state as state_storage
from amp8.optim.bound import SLACK, ratio_bound

BETAS = [(0.9, 0.999), (0.8, 0.95), (0.5, 0.99), (0.0, 0.999), (0.99, 0.9)]


def _torch_adam_move(gradients: list[float], betas: tuple[float, float], lr: float = 1.0) -> float:
    """How far ``torch.optim.Adam`` (eps negligible) moves a scalar weight on the last of ``gradients``."""
    weight = nn.Parameter(torch.zeros((), dtype=torch.float64))
    optimizer = torch.optim.Adam([weight], lr=lr, betas=betas, eps=1e-300)
    before = 0.0
    for gradient in gradients:
        before = float(weight)
        weight.grad = torch.tensor(gradient, dtype=torch.float64)
        optimizer.step()
    return abs(float(weight) - before)


@pytest.mark.parametrize("betas", BETAS)
@pytest.mark.parametrize("step", [1, 2, 7, 60])
def test_exact_adam_reaches_the_bound_and_never_passes_it(betas: tuple[float, float], step: int) -> None:
    """Gradients ``(b1 / b2) ** k`` k steps back make Cauchy-Schwarz an equality: torch's
    Adam then moves the weight by exactly the bound (over ``SLACK``); random gradients stay
    below it."""
    beta1, beta2 = betas
    bound = ratio_bound(beta1, beta2, step) / SLACK / (1 - beta1**step)  # in learning rates
    worst = [(beta1 / beta2) ** (step - 1 - i) for i in range(step)]
    assert _torch_adam_move(worst, betas) == pytest.approx(bound, rel=1e-9)
    generator = torch.Generator().manual_seed(step)
    for _ in range(20):
        gradients = (torch.randn(step, generator=generator, dtype=torch.float64) * 10 ** torch.randn(
            step, generator=generator, dtype=torch.float64)).tolist()
        assert _torch_adam_move(gradients, betas) <= bound * (1 + 1e-9)


def test_bound_values() -> None:
    """The first step moves a weight by one learning rate (times ``SLACK``); no second
    moment (``beta2 = 0``) gives no bound."""
    assert ratio_bound(0.9, 0.999, 1) / (1 - 0.9) == pytest.approx(SLACK)
    assert ratio_bound(0.9, 0.0, 5) == math.inf
    assert ratio_bound(0.9, 0.999, 1e6) / SLACK == pytest.approx(0.1 * math.sqrt(1 / (1 - 0.81 / 0.999) / 0.001))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_flushed_second_moment_cannot_blow_up_a_step(level: str) -> None:
    """A second moment stored as zero under a nonzero first moment (what a flushed FP16
    value gives): the step stays within the bound instead of moving by m / eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    lr = 0.01
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), level)
    weight = model[0].weight
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    state = optimizer.state[weight]
    stored = state_storage.load(state, "exp_avg_sq")
    state_storage.store(state, "exp_avg_sq", torch.zeros_like(stored), state_storage.layout_of(state, "exp_avg_sq"))
    before = optimizer.master_weight(weight).clone()
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    moved = float((optimizer.master_weight(weight) - before).abs().max())
    assert moved <= lr * ratio_bound(0.9, 0.999, 2) / (1 - 0.9**2) * 1.01, f"moved {moved / lr:.1f} x lr"


RECIPES = ["tensorwise", "rowwise", "deepseek", "mxfp8", "nvfp4"]


def _real_weights(model: nn.Module, optimizer: LowBitAdam) -> dict[str, torch.Tensor]:
    """The real float32 weights (O3: the master weights)."""
    exported = amp8.export(model, optimizer if optimizer.level.master_weight is not None else None)
    return {name: value.clone() for name, value in exported.state_dict().items()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_token_outlier_moves_no_weight_past_adams_bound(level: str, recipe: str) -> None:
    """An MLP trains three AdamW steps; on the second, one of 16 batch rows is 1000 times
    the others. No weight moves by more than 3 learning rates in a step (exact Adam's bound
    is 1.3 here). Before the second moment took the first moment's tiles and the step
    was held to the bound, the outlier step moved an O2 weight by 500-1000 lr."""
    torch.manual_seed(0)
    lr = 0.01
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = amp8.initialize(model, optimizer, level, recipe=amp8.Recipe.preset(recipe))
    for step in range(3):
        x, target = torch.randn(16, 64), torch.randn(16, 64)
        if step == 1:
            x[3] *= 1000
        before = _real_weights(model, optimizer)
        nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.skipped_steps == 0
        for name, value in _real_weights(model, optimizer).items():
            moved = float((value - before[name]).abs().max())
            assert moved <= 3 * lr, f"step {step}: {name} moved {moved / lr:.1f} x lr"


def _model_of_every_kind() -> nn.Module:
    """An embedding, FP8 linear layers, a mixture of experts' stacks, biases and a norm."""
    from moe_models import TinyMoeBlock

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(64, 32), nn.Linear(32, 32), nn.LayerNorm(32), TinyMoeBlock(4, 32), nn.Linear(32, 32)
    )


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_both_moments_of_every_parameter_take_the_same_scale_layout(level: str, recipe: str) -> None:
    """Adam's FP8 first and FP16 second moment of every parameter (FP8 layers' weights,
    the embedding table, the experts' stacks, biases and norms) have scales of one shape:
    the second moment is never coarser than the first, at init and after a step."""
    model = _model_of_every_kind()
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, recipe=amp8.Recipe.preset(recipe)
    )
    for stepped in (False, True):
        if stepped:
            model(torch.randint(0, 64, (2, 8))).square().mean().backward()
            optimizer.step()
        for param, state in optimizer.state.items():
            first, second = state["exp_avg_scale"], state["exp_avg_sq_scale"]
            assert first.shape == second.shape, f"{tuple(param.shape)} after {int(stepped)} steps"
            tilings = [state_storage.layout_of(state, key).to_state() for key in ("exp_avg", "exp_avg_sq")]
            for tiling in tilings:
                for differs in ("dtype", "stream"):
                    tiling.pop(differs)
            assert tilings[0] == tilings[1], f"{tuple(param.shape)}"
