"""``Fp8Linear.from_conv1d``: GPT-2's ``Conv1D`` (``y = x W + b``, weight (in, out)) in FP8,
with the weight Parameter, its gradient and its checkpoint entry in the Conv1D's shape."""

import warnings

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from amp8 import Recipe
from amp8.config.levels import Precision
from amp8.nn import Fp8Linear
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_sqnr_at_least

RECIPES = {
    "tensorwise": Recipe(),
    "rowwise": Recipe.preset("rowwise"),
    "block": Recipe.preset("deepseek"),
    "mxfp8": Recipe.preset("mxfp8"),
}
# How each opt level stores the weight: O1/O2 FP16 + scale, O3 FP8 + scale, O1-compute as is.
STORAGES = {"O1/O2": Precision.FP16, "O3": Precision.FP8, "O1-compute": Precision.AS_IS}
# (input shape, in_features (nx), out_features (nf)): (B, T, C), square, M not a multiple of 16,
# and GPT-2's qkv shape (out = 3 * in).
SHAPES = [((2, 5, 32), 32, 96), ((64, 64), 64, 64), ((13, 48), 48, 128), ((1, 3, 128), 128, 32)]


def _conv1d_pair(nx: int, nf: int, recipe: Recipe, storage: Precision) -> tuple[Conv1D, Fp8Linear]:
    """A Conv1D and the Fp8Linear that replaced a copy of it, holding the same real weight."""
    reference = Conv1D(nf, nx)
    with torch.no_grad():
        reference.bias.normal_()
    original = Conv1D(nf, nx)
    original.load_state_dict(reference.state_dict())
    layer = Fp8Linear.from_conv1d(original, recipe, Precision.FP16 if storage is Precision.FP8 else storage)
    if storage is Precision.FP8:
        layer.set_weight_storage(storage)
    with torch.no_grad():  # the reference computes with what the layer stores
        reference.weight.copy_(layer.read_weight())
    return reference, layer


def _run(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(grad_out)
    return y, x.grad


def _weight_grad(layer: Fp8Linear) -> torch.Tensor:
    grad = layer.weight.grad
    return grad.fp8.dequantize() if isinstance(grad, WeightGrad) else grad.float()


@pytest.mark.parametrize(("shape", "nx", "nf"), SHAPES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("level", list(STORAGES))
def test_forward_and_gradients_against_the_conv1d(shape, nx, nf, recipe_name, level) -> None:
    reference, layer = _conv1d_pair(nx, nf, RECIPES[recipe_name], STORAGES[level])
    x = torch.randn(shape)
    grad_out = torch.randn(*shape[:-1], nf)
    y_ref, gx_ref = _run(reference, x, grad_out)
    y, gx = _run(layer, x, grad_out)
    assert y.shape == y_ref.shape and gx.shape == x.shape
    assert_sqnr_at_least(y_ref, y, 18.0)
    assert_sqnr_at_least(gx_ref, gx, 17.0)
    assert layer.weight.grad.shape == (nx, nf), "the weight gradient has the Parameter's (in, out) shape"
    assert_sqnr_at_least(reference.weight.grad, _weight_grad(layer), 17.0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("level", list(STORAGES))
def test_parameters_and_state_dict_keep_the_conv1d_shapes(recipe_name, level) -> None:
    conv = Conv1D(96, 32)
    keys = {key: tuple(value.shape) for key, value in conv.state_dict().items()}
    weight, bias = conv.weight, conv.bias
    layer = Fp8Linear.from_conv1d(conv, RECIPES[recipe_name], STORAGES[level])
    assert layer.weight is weight and layer.bias is bias, "the Conv1D's Parameters must be reused"
    assert (layer.in_features, layer.out_features) == (32, 96)
    saved = {key: tuple(value.shape) for key, value in layer.state_dict().items() if key in keys}
    assert saved == keys


def test_is_exact_where_the_weight_is_stored_as_fp8_with_one_scale() -> None:
    """At O3 with one scale per tensor the GEMMs take the stored FP8 bytes transposed: the
    same values as a cast of the real weight, no second rounding."""
    reference, layer = _conv1d_pair(64, 32, Recipe(), Precision.FP8)
    stored = layer.stored_weight.stored()
    fp8 = layer.fp8_weight()
    assert fp8.shape == (32, 64) and fp8.data.is_contiguous()
    torch.testing.assert_close(fp8.dequantize(), stored.dequantize().t(), atol=0, rtol=0)


def test_loads_a_plain_conv1d_checkpoint() -> None:
    """A GPT-2 checkpoint (``from_pretrained``) loads into the FP8 layer: its (in, out)
    weight is re-stored."""
    source = Conv1D(64, 32)
    layer = Fp8Linear.from_conv1d(Conv1D(64, 32), Recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain form, as the layer's own state_dict() gives
        layer.load_state_dict(source.state_dict())
    assert layer.state_dict().keys() == source.state_dict().keys()
    assert_sqnr_at_least(source.weight.detach(), layer.read_weight(), 40.0)
    torch.testing.assert_close(layer.bias, source.bias, atol=0, rtol=0)


def test_replaced_module_is_the_conv1d_with_the_real_weight() -> None:
    conv = Conv1D(48, 32)
    layer = Fp8Linear.from_conv1d(conv, Recipe())
    plain = layer.replaced_module(layer.read_weight())
    assert type(plain) is Conv1D and plain.nf == 48
    assert plain.weight is not layer.weight and plain.weight.dtype == torch.float32
    x = torch.randn(3, 32)
    assert_sqnr_at_least(plain(x).detach(), layer(x).detach(), 18.0)


def test_replaced_module_of_a_linear_layer_is_refused() -> None:
    layer = Fp8Linear.from_linear(nn.Linear(32, 32), Recipe())
    with pytest.raises(TypeError, match="from_conv1d"):
        layer.replaced_module(layer.read_weight())


def test_from_conv1d_refuses_a_module_without_a_2d_weight() -> None:
    with pytest.raises(TypeError, match="Conv1D-like"):
        Fp8Linear.from_conv1d(nn.LayerNorm(32), Recipe())


def test_repr_says_the_weight_is_transposed() -> None:
    layer = Fp8Linear.from_conv1d(Conv1D(48, 32), Recipe())
    assert "in_features=32, out_features=48" in repr(layer) and "weight_transposed=True" in repr(layer)


def test_tensor_parallel_narrowing_is_refused() -> None:
    layer = Fp8Linear.from_conv1d(Conv1D(64, 32), Recipe())
    with pytest.raises(ValueError, match="keep this layer out of the tensor-parallel plan"):
        layer.narrow_weight(0, 0, 16)
