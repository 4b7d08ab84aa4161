"""An FP8 weight gradient behaves as a gradient wherever torch code touches one: it is
the Parameter's autograd gradient (hooks, ``torch.autograd.grad``, ``retain_graph``, a
layer called twice), torch's clipping takes it, and scaling it gives the scaled values."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import amp8
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal, assert_sqnr_at_least, mlp

FP8_LEVELS = ["O1", "O2", "O3"]
PRESETS = ["tensorwise", "rowwise", "deepseek", "mxfp8"]


def _model(level: str, preset: str = "tensorwise") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(64, 128, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = amp8.Recipe.preset(preset)
    if level == "O1-compute":
        return amp8.initialize(model, optimizer, amp8.config.levels.FP8_COMPUTE_ONLY, recipe=recipe)
    return amp8.initialize(model, optimizer, level, recipe=recipe)


def _loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
    return model(x).square().mean()


def _real(grad: torch.Tensor) -> torch.Tensor:
    return grad.dequantize() if isinstance(grad, WeightGrad) else grad.float()


@pytest.mark.parametrize("level", FP8_LEVELS)
@pytest.mark.parametrize(
    ("name", "scaled", "factor"),
    [
        ("g * 0.5", lambda g: g * 0.5, 0.5),
        ("0.5 * g", lambda g: 0.5 * g, 0.5),
        ("g / 4", lambda g: g / 4, 0.25),
        ("torch.mul", lambda g: torch.mul(g, 3.0), 3.0),
        ("torch.div", lambda g: torch.div(g, 8), 0.125),
        ("g.mul_", lambda g: g.clone().mul_(0.5), 0.5),
        ("g.div_", lambda g: g.clone().div_(4), 0.25),
    ],
)
def test_scaling_a_weight_gradient_scales_it_the_right_way(level: str, name: str, scaled, factor: float) -> None:
    """Out of place as in place: ``p.grad = p.grad / accum_steps`` divides."""
    model, _ = _model(level)
    _loss(model).backward()
    grad = model[0].weight.grad
    result = scaled(grad)
    assert isinstance(result, WeightGrad)
    torch.testing.assert_close(result.dequantize(), grad.dequantize() * factor, atol=0, rtol=2**-21)
    model[0].weight.grad = grad / 2
    torch.testing.assert_close(model[0].weight_grad.dequantize(), grad.dequantize() / 2, atol=0, rtol=2**-21)


@pytest.mark.parametrize("level", FP8_LEVELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_tensor_hooks_see_and_change_the_weight_gradient(level: str, preset: str) -> None:
    """``register_hook`` gets the gradient and its result is what accumulates; a
    post-accumulate-grad hook finds it in ``p.grad``."""
    model, _ = _model(level, preset)
    seen, accumulated = [], []
    model[0].weight.register_hook(lambda grad: seen.append(_real(grad)) or grad.clamp(-1e-3, 1e-3))
    model[0].weight.register_post_accumulate_grad_hook(lambda param: accumulated.append(type(param.grad)))
    _loss(model).backward()
    assert len(seen) == 1 and accumulated == [WeightGrad]
    clamped = model[0].weight_grad.dequantize()
    assert float(clamped.abs().max()) <= 1e-3 * (1 + 2**-20)  # 1e-3 in float32
    torch.testing.assert_close(clamped, seen[0].clamp(-1e-3, 1e-3), atol=1e-3 * 2**-4, rtol=2**-4)


@pytest.mark.parametrize("level", [*FP8_LEVELS, "O1-compute"])
def test_autograd_grad_returns_the_weight_gradient(level: str) -> None:
    """As ``backward()`` would accumulate it, and leaving ``.grad`` alone."""
    model, _ = _model(level)
    (grad,) = torch.autograd.grad(_loss(model), [model[0].weight])
    assert model[0].weight.grad is None
    _loss(model).backward()
    assert type(grad) is type(model[0].weight.grad)
    assert_bitwise_equal(_real(grad), _real(model[0].weight.grad))


@pytest.mark.parametrize("level", [*FP8_LEVELS, "O1-compute"])
def test_backward_twice_through_a_retained_graph_accumulates(level: str) -> None:
    model, _ = _model(level)
    loss = _loss(model)
    loss.backward(retain_graph=True)
    once = _real(model[0].weight.grad).clone()
    loss.backward()
    twice = _real(model[0].weight.grad)
    torch.testing.assert_close(twice, 2 * once, atol=0, rtol=2**-3)  # within the FP8 rounding of the sum
    if level != "O1-compute":
        assert isinstance(model[0].weight.grad, WeightGrad)


@pytest.mark.parametrize("level", FP8_LEVELS)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_with_foreach_clips_as_without(level: str, norm_type: float) -> None:
    model, _ = _model(level)
    _loss(model).backward()
    twin = copy.deepcopy(model)
    _loss(twin).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type, foreach=True)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e-3, norm_type, foreach=False)
    torch.testing.assert_close(total, expected, atol=0, rtol=0)
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        assert_bitwise_equal(_real(ours.grad), _real(theirs.grad))


class _Twice(nn.Module):
    """One linear layer called twice in a forward (a tied or recurrent block)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


@pytest.mark.parametrize("level", FP8_LEVELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_a_layer_called_twice_gets_the_sum_of_both_gradients(level: str, preset: str) -> None:
    reference = _Twice()
    model, _ = amp8.initialize(_Twice(), None, level, recipe=amp8.Recipe.preset(preset))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    reference(x).square().mean().backward()
    model(x).square().mean().backward()
    assert isinstance(model.block.weight.grad, WeightGrad)
    assert_sqnr_at_least(reference.block.weight.grad, model.block.weight_grad.dequantize(), 17.0)


@pytest.mark.parametrize("level", FP8_LEVELS)
def test_a_dropped_model_is_freed(level: str) -> None:
    """The Parameter's way to its gradient (autograd nodes that hold it) makes no
    reference cycle the garbage collector cannot see."""
    model, optimizer = _model(level)
    _loss(model).backward()
    optimizer.step()
    dropped = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert dropped() is None, "the model outlived every reference to it"


PLAIN_GRADS = {  # torch itself refuses a .grad of another dtype than the Parameter's
    "zeros_like(weight)": lambda weight: torch.zeros_like(weight),
    "the real gradient": lambda weight: weight.grad.dequantize().to(weight.dtype),
}


@pytest.mark.parametrize("level", FP8_LEVELS)
@pytest.mark.parametrize("plain", list(PLAIN_GRADS))
@pytest.mark.parametrize("clear", ["optimizer.zero_grad()", "weight.grad = None"])
def test_a_plain_tensor_in_weight_grad_fails_backward_naming_zero_grad(level: str, plain: str, clear: str) -> None:
    """Backward cannot add an FP8 gradient to a plain ``.grad`` assigned by hand: the error
    says to clear it and let backward make the gradient, and doing so works."""
    model, optimizer = _model(level)
    _loss(model).backward()
    weight = model[0].weight
    weight.grad = PLAIN_GRADS[plain](weight)
    with pytest.raises(TypeError, match=r"backward cannot add .* holds a plain tensor .* optimizer\.zero_grad\(\) "
                                        r"\(or weight\.grad = None\)"):
        _loss(model).backward()
    if clear == "optimizer.zero_grad()":
        optimizer.zero_grad()
    else:
        weight.grad = None
    _loss(model).backward()
    assert isinstance(weight.grad, WeightGrad)


@pytest.mark.parametrize("level", FP8_LEVELS)
def test_a_stock_optimizer_over_fp8_weights_is_told_to_use_amp8s(level: str) -> None:
    """Outside backward, writing the FP8 gradient into a plain tensor is an optimizer's
    step, and the error names amp8's optimizer, not ``zero_grad``."""
    model, _ = _model(level)
    _loss(model).backward()
    stock = torch.optim.SGD([model[0].weight], lr=0.1)
    with pytest.raises(TypeError, match=r"would write an FP8 weight gradient .* amp8\.initialize returns"):
        stock.step()
