import pytest
import torch
from torch import nn

import amp8
from conftest import mlp


def _model_with_grads(level: str = "O1"):
    model = mlp(32, 64, 10, seed=None)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=amp8.Recipe())
    model(torch.randn(16, 32)).pow(2).sum().backward()
    return model, optimizer


def _all_grads(model: nn.Module) -> torch.Tensor:
    grads = []
    for module in model.modules():
        if isinstance(module, amp8.nn.Fp8Linear) and module.weight_grad is not None:
            grads.append(module.weight_grad.dequantize().flatten())
        for name, param in module.named_parameters(recurse=False):
            fp8_weight = isinstance(module, amp8.nn.Fp8Linear) and name == "weight"
            if param.grad is not None and not fp8_weight:
                grads.append(param.grad.flatten())
    return torch.cat(grads)


@pytest.mark.parametrize("use_optimizer", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norm_covers_fp8_and_ordinary_gradients(use_optimizer: bool, norm_type: float) -> None:
    model, optimizer = _model_with_grads()
    expected = torch.linalg.vector_norm(_all_grads(model), norm_type)
    source = optimizer if use_optimizer else model
    total = amp8.clip_grad_norm_(source, max_norm=float(expected) / 4, norm_type=norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    after = torch.linalg.vector_norm(_all_grads(model), norm_type)
    assert float(after) == pytest.approx(float(expected) / 4, rel=1e-4)


def test_fp8_gradients_are_scaled_exactly() -> None:
    model, _ = _model_with_grads()
    before = model[0].weight_grad
    before_data, before_scale = before.data.clone(), before.scale.clone()  # weight_grad is live
    amp8.clip_grad_norm_(model, max_norm=1e-3)
    after = model[0].weight_grad
    assert torch.equal(after.data.view(torch.uint8), before_data.view(torch.uint8))
    assert float(after.scale) > float(before_scale)


def test_small_norm_is_left_alone() -> None:
    model, _ = _model_with_grads()
    before = _all_grads(model).clone()
    amp8.clip_grad_norm_(model, max_norm=1e9)
    assert torch.equal(_all_grads(model), before)


def test_parameter_iterable_is_refused() -> None:
    model, _ = _model_with_grads()
    with pytest.raises(TypeError, match="torch.nn.utils.clip_grad_norm_ handles FP8 weight gradients too"):
        amp8.clip_grad_norm_(model.parameters(), 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_norm", "norm_type"), [(-1.0, 2.0), (float("nan"), 2.0), (1.0, 0.0), (1.0, -2.0)])
def test_out_of_range_arguments_are_refused(max_norm: float, norm_type: float) -> None:
    model, _ = _model_with_grads()
    before = model[0].weight_grad.scale.clone()
    with pytest.raises(ValueError, match="max_norm|norm_type"):
        amp8.clip_grad_norm_(model, max_norm=max_norm, norm_type=norm_type)
    assert torch.equal(model[0].weight_grad.scale, before), "a refused clip must change nothing"
