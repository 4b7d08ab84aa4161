import io

import pytest
import torch
from torch import nn

import amp8
from amp8.formats import E5M2
from amp8.nn import Fp8Linear
from amp8.optim import LowBitAdam
from amp8.tensor import ScaledTensor
from conftest import assert_bitwise_equal

HYPERPARAMETERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam-l2": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "adam-maximize": (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.95), maximize=True)),
}


def _high_precision_model() -> nn.Module:
    # Features that are not multiples of 16: nothing is swapped, every parameter is FP32.
    return nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3))


@pytest.mark.parametrize("case", list(HYPERPARAMETERS))
def test_matches_torch_bit_for_bit_on_fp32_parameters(case: str) -> None:
    """Same operations in the same order as torch's single-tensor Adam: exact."""
    optimizer_class, kwargs = HYPERPARAMETERS[case]
    reference = _high_precision_model()
    model = _high_precision_model()
    model.load_state_dict(reference.state_dict())
    reference_optimizer = optimizer_class(reference.parameters(), foreach=False, **kwargs)
    model, optimizer = amp8.initialize(model, optimizer_class(model.parameters(), **kwargs), "O1")
    for _ in range(20):
        x = torch.randn(8, 10)
        for m, opt in ((reference, reference_optimizer), (model, optimizer)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_bitwise_equal(p.detach(), q.detach())


def test_fp8_layer_step_matches_torch_within_fp16_rounding() -> None:
    """Given the same gradients, moments are bit-identical and the weight differs from an
    FP32 AdamW step only by the rounding of its FP16 storage (half an FP16 ulp)."""
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    layer: Fp8Linear = model[0]
    reference = nn.Parameter(layer.read_weight())
    reference_optimizer = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(10):
        grad = ScaledTensor.from_float(torch.randn(32, 64) * 1e-3, E5M2)
        layer.weight_grad = grad
        with torch.no_grad():
            reference.copy_(layer.read_weight())
        reference.grad = grad.dequantize()
        optimizer.step()
        reference_optimizer.step()
        state, reference_state = optimizer.state[layer.weight], reference_optimizer.state[reference]
        assert_bitwise_equal(state["exp_avg"], reference_state["exp_avg"])
        assert_bitwise_equal(state["exp_avg_sq"], reference_state["exp_avg_sq"])
        half_ulp = 2.0 ** -11 * reference.detach().abs()
        difference = (layer.read_weight() - reference.detach()).abs()
        assert bool((difference <= half_ulp + 1e-12).all()), f"max excess {(difference - half_ulp).max()}"


def _fp8_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))


def test_overflowing_step_changes_nothing_and_is_counted() -> None:
    model = _fp8_model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    states = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    x = torch.randn(4, 32)
    x[0, 0] = float("inf")
    model(x).sum().backward()
    optimizer.step()
    assert optimizer.skipped_steps == 1
    for key, value in model.state_dict().items():
        if key.endswith(("weight", "bias")):
            assert_bitwise_equal(value, weights[key])
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert_bitwise_equal(value, states[id(param)][key])
    optimizer.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert float(optimizer.state[model[0].weight]["step"]) == 2


def test_zero_grad_clears_fp8_and_ordinary_gradients() -> None:
    model = _fp8_model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    model(torch.randn(4, 32)).sum().backward()
    assert model[0].weight_grad is not None and model[0].bias.grad is not None
    optimizer.zero_grad()
    assert model[0].weight_grad is None and model[0].bias.grad is None


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_checkpoint_restores_exactly_and_training_continues_identically(scaling: str) -> None:
    recipe = amp8.Recipe(scaling=scaling, amax_history_len=4)
    batches = [torch.randn(8, 32) for _ in range(6)]

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)
        model = _fp8_model()
        return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1", recipe)

    model, optimizer = build()
    uninterrupted = _train(model, optimizer, batches)

    model, optimizer = build()
    first_half = _train(model, optimizer, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    resumed_model, resumed_optimizer = build()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for key, value in model.state_dict().items():
        assert_bitwise_equal(resumed_model.state_dict()[key], value)
    for param, resumed_param in zip(model.parameters(), resumed_model.parameters()):
        for key, value in optimizer.state[param].items():
            assert_bitwise_equal(resumed_optimizer.state[resumed_param][key], value)
    assert resumed_optimizer.state[resumed_model[0].weight]["exp_avg"].dtype == torch.float32
    second_half = _train(resumed_model, resumed_optimizer, batches[3:])
    assert first_half + second_half == uninterrupted


def test_skipped_steps_survive_a_checkpoint() -> None:
    model = _fp8_model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    optimizer.skipped_steps = 3
    other = LowBitAdam(model.parameters())
    other.load_state_dict(optimizer.state_dict())
    assert other.skipped_steps == 3
