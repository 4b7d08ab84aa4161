"""Empty batches: an amp8 model answers them as ``nn.Linear`` does, at every opt level,
granularity and scaling, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp8
from amp8.config.formats import E4M3, E5M2
from amp8.config.gemms import Gemm
from amp8.nn import Fp8Linear
from amp8.ops.gemm import fp8_gemm
from amp8.quant import scaling
from amp8.tensor.scaled import ScaledTensor
from conftest import assert_bitwise_equal

RECIPES = {
    "tensorwise-current": amp8.Recipe(),
    "tensorwise-delayed": amp8.Recipe(scaling="delayed"),
    "tensorwise-none": amp8.Recipe(scaling="none"),
    "rowwise-current": amp8.Recipe.preset("rowwise"),
    "rowwise-none": amp8.Recipe.preset("rowwise").replace(scaling="none"),
    "block-current": amp8.Recipe.preset("deepseek"),
    "block-none": amp8.Recipe.preset("deepseek").replace(scaling="none"),
}
EMPTY_SHAPES = [(0, 32), (4, 0, 32)]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_empty_batch_matches_nn_linear(level: str, recipe_name: str, shape: tuple[int, ...]) -> None:
    reference = _model()
    model = _model()
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = amp8.initialize(model, optimizer, level, recipe=RECIPES[recipe_name])
    x_ref = torch.randn(shape, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()

    expected = reference(x_ref)
    got = model(x)
    expected.sum().backward()
    got.sum().backward()
    optimizer.step()

    assert_bitwise_equal(got.detach(), expected.detach())
    assert_bitwise_equal(x.grad, x_ref.grad)
    assert_bitwise_equal(model[2].bias.grad, reference[2].bias.grad)
    for layer in (model[0], model[2]):
        assert isinstance(layer, Fp8Linear)
        stored = layer.weight_grad
        assert stored is not None, "backward of an empty batch left no weight gradient"
        assert not stored.dequantize().any(), "the weight gradient of an empty batch is not zero"
        assert torch.isfinite(layer.read_weight()).all()


@pytest.mark.parametrize("recipe_name", ["tensorwise-current", "tensorwise-delayed"])
def test_empty_batch_keeps_the_previous_scales(recipe_name: str) -> None:
    layer = Fp8Linear.from_linear(nn.Linear(32, 16), RECIPES[recipe_name])
    layer(torch.randn(8, 32))
    before = layer.scale.clone()
    layer(torch.randn(0, 32))
    assert_bitwise_equal(layer.scale, before)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16])
@pytest.mark.parametrize("shape", [(0,), (0, 32), (4, 0, 32)], ids=str)
def test_amax_of_an_empty_tensor_is_zero(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    assert_bitwise_equal(scaling.amax(torch.empty(shape, dtype=dtype)), torch.tensor(0.0))


@pytest.mark.parametrize(
    ("shape", "tile", "scale_shape"),
    [
        ((0, 32), None, ()),
        ((0, 32), (1, 32), (1, 1)),
        ((0, 32), (0, 1), (1, 32)),
        ((0, 256), (1, 128), (1, 2)),
        ((0, 32), (128, 1), (1, 32)),
        ((16, 0), (1, 0), (16, 1)),
    ],
    ids=str,
)
def test_quantize_tiles_of_an_empty_tensor(
    shape: tuple[int, int], tile: tuple[int, int] | None, scale_shape: tuple[int, ...]
) -> None:
    data, scales = scaling.quantize_tiles(torch.empty(shape), E4M3, tile)
    assert_bitwise_equal(data, torch.empty(shape, dtype=E4M3))
    assert_bitwise_equal(scales, torch.ones(scale_shape))


@pytest.mark.parametrize("block_size", [0, 128])
def test_quantize_blockwise_of_an_empty_tensor(block_size: int) -> None:
    data, scales = scaling.quantize_blockwise(torch.empty(4, 0), E4M3, block_size)
    assert_bitwise_equal(data, torch.empty(4, 0, dtype=E4M3))
    assert_bitwise_equal(scaling.dequantize_blockwise(data, scales, block_size), torch.empty(4, 0))


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
@pytest.mark.parametrize(("m", "k"), [(0, 32), (16, 0)], ids=["empty-M", "empty-K"])
def test_fp8_gemm_of_empty_operands(m: int, k: int, granularity: str) -> None:
    """An empty M gives an empty product; an empty K (the weight gradient of an empty
    batch) gives zeros, as ``torch.mm`` does."""
    n = 32
    recipe = amp8.Recipe(granularity=granularity, block_size=16)
    a = ScaledTensor.from_float(torch.empty(m, k), E4M3, tile=recipe.tile((m, k), 1))
    b = ScaledTensor.from_float(torch.empty(n, k), E5M2, tile=recipe.tile((n, k), 1, weight=True))
    got = fp8_gemm(a, b.t(), torch.float32, Gemm.WGRAD)
    assert_bitwise_equal(got, torch.zeros(m, k) @ torch.zeros(k, n))
