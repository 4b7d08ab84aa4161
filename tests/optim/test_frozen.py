"""Frozen parameters (``requires_grad=False``): no gradient, no Adam state, no master
weight, and at O3 an FP8 weight that stays exactly as loaded."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import amp8
from amp8.config.levels import FP8_COMPUTE_ONLY
from conftest import assert_bitwise_equal

LEVELS = ["O1", "O2", "O3"]
WIDTH = 64


def _model() -> nn.Sequential:
    """A frozen base layer under a trainable one: the shape of adapter fine-tuning."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    model[0].requires_grad_(False)
    return model


def _optimizer(model: nn.Module, given: str) -> torch.optim.Optimizer:
    params = model.parameters() if given == "all" else [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, WIDTH, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("given", ["all", "trainable"])
@pytest.mark.parametrize("level", LEVELS)
def test_frozen_weight_gets_no_gradient_state_or_master_and_stays_exact(level: str, given: str) -> None:
    model = _model()
    model, optimizer = amp8.initialize(model, _optimizer(model, given), level)
    frozen, trainable = model[0], model[2]
    stored, scale = frozen.stored_weight.data.clone(), frozen.weight_scale.clone()
    trained_before = trainable.read_weight()
    _train(model, optimizer, steps=5)
    assert frozen.weight.grad is None and frozen.bias.grad is None
    assert not optimizer.state.get(frozen.weight), "a frozen weight must hold no optimizer state"
    assert not optimizer.state.get(frozen.bias), "a frozen bias must hold no optimizer state"
    assert_bitwise_equal(frozen.stored_weight.data, stored)
    assert_bitwise_equal(frozen.weight_scale, scale)
    assert not torch.equal(trainable.read_weight(), trained_before), "the trainable layer must train"
    assert "exp_avg" in optimizer.state[trainable.weight]
    expected_dtype = torch.float8_e4m3fn if level == "O3" else torch.float16
    assert frozen.weight_dtype == expected_dtype
    if level == "O3":
        assert "master" in optimizer.state[trainable.weight]


@pytest.mark.parametrize("level", LEVELS)
def test_report_says_frozen_and_counts_one_byte_per_frozen_fp8_weight_at_o3(level: str) -> None:
    model = _model()
    model, optimizer = amp8.initialize(model, _optimizer(model, "all"), level)
    _train(model, optimizer, steps=1)
    rows = {row.name: row for row in amp8.report(model, optimizer).rows}
    assert rows["0.weight"].grad == "frozen" and rows["0.weight"].frozen is True
    assert rows["0.bias"].grad == "frozen"
    assert rows["2.weight"].frozen is False and rows["2.weight"].grad != "frozen"
    frozen = model[0]
    weight_bytes = frozen.stored_weight.data.nbytes + frozen.weight_scale.nbytes
    assert rows["0.weight"].bytes == weight_bytes, "a frozen weight holds its storage and scales only"
    if level == "O3":  # one byte per element plus one float32 scale per row
        assert rows["0.weight"].bytes == WIDTH * WIDTH + 4 * WIDTH
        assert rows["0.weight"].bytes / (WIDTH * WIDTH) <= 1.1


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_with_frozen_parameters_resumes_bit_for_bit(level: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _model()
        return amp8.initialize(model, _optimizer(model, "all"), level)  # type: ignore[return-value]

    model, optimizer = build()
    _train(model, optimizer, steps=2)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    _train(model, optimizer, steps=2, seed=2)
    resumed, resumed_optimizer = build()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_optimizer, steps=2, seed=2)
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(actual.view(torch.uint8) if actual.element_size() == 1 else actual,
                           expected.view(torch.uint8) if expected.element_size() == 1 else expected), name
    assert not resumed_optimizer.state.get(resumed[0].weight)


def test_weight_unfrozen_after_initialize_takes_state_at_its_first_step() -> None:
    model = _model()
    model, optimizer = amp8.initialize(model, _optimizer(model, "all"), "O3")
    model[0].weight.requires_grad_(True)
    before = model[0].read_weight()
    _train(model, optimizer, steps=1)
    assert {"exp_avg", "master"} <= set(optimizer.state[model[0].weight])
    assert not torch.equal(model[0].read_weight(), before)


@pytest.mark.parametrize("given", ["all", "trainable"])
def test_fp8_compute_only_trains_beside_frozen_weights_with_any_optimizer(given: str) -> None:
    model = _model()
    params = model.parameters() if given == "all" else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model, optimizer = amp8.initialize(model, optimizer, FP8_COMPUTE_ONLY)
    assert isinstance(model[0], amp8.nn.Fp8Linear)
    frozen_before, trained_before = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    _train(model, optimizer, steps=3)  # type: ignore[arg-type]
    assert model[0].weight.grad is None
    assert_bitwise_equal(model[0].weight.detach(), frozen_before)
    assert not torch.equal(model[2].weight.detach(), trained_before)
    assert not optimizer.state.get(model[0].weight)  # type: ignore[union-attr]


def test_export_keeps_frozen_weights_frozen() -> None:
    model, _ = amp8.initialize(_model(), None, "O3")
    exported = amp8.export(model)
    assert [p.requires_grad for p in exported.parameters()] == [p.requires_grad for p in model.parameters()]
