"""Health signals of FP8 casts (amp8.quant.health): exact counts on built tensors, and which
GEMM operands an Fp8Linear watches at every granularity and override."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import amp8
from amp8.config.formats import E4M3, E5M2, max_value
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import CastRule, Quantizer, TensorRole
from amp8.quant import scaling
from amp8.quant.health import (
    GemmOperand, Signal, block_cast_health, cast_health, clip_limit, new_health, record_health, sqnr_db,
)
from amp8.tensor import block_scaled as microscaling


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("n_flushed", [0, 3, 17])
def test_underflow_share_counts_exactly_the_nonzero_values_that_become_zero(dtype, n_flushed) -> None:
    smallest = float(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps)  # one subnormal step
    x = torch.full((64,), 1.0)
    x[:n_flushed] = smallest / 4  # below half the smallest subnormal: rounds to zero
    x[20:30] = 0.0  # zeros are not counted as flushed
    x[40] = max_value(dtype)
    scale = torch.ones(())
    data = scaling.quantize(x, scale, dtype)
    signals = cast_health(x, scale, data)
    nonzero = 64 - 10
    assert signals[Signal.AMAX] == max_value(dtype)
    assert signals[Signal.UNDERFLOW] == pytest.approx(n_flushed / nonzero)
    assert signals[Signal.SATURATED] == 0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_counts_values_beyond_the_rounding_of_the_max(dtype) -> None:
    limit = clip_limit(dtype)
    x = torch.tensor([max_value(dtype), limit * 0.999, limit * 1.01, 1e30, 1.0])
    scale = torch.ones(())
    signals = cast_health(x, scale, scaling.quantize(x, scale, dtype))
    assert signals[Signal.SATURATED] == pytest.approx(2 / 5)
    assert max_value(dtype) < limit < 2 * max_value(dtype)


def test_record_keeps_the_largest_signal_per_operand() -> None:
    health = new_health()
    record_health(health, (GemmOperand.FPROP_INPUT, GemmOperand.WGRAD_INPUT), torch.tensor([2.0, 0.1, 0.5, 1e-3]))
    record_health(health, (GemmOperand.FPROP_INPUT,), torch.tensor([3.0, 0.0, 0.2, 1e-4]))
    assert health[GemmOperand.FPROP_INPUT].tolist() == pytest.approx([3.0, 0.1, 0.5, 1e-3])
    assert health[GemmOperand.WGRAD_INPUT].tolist() == pytest.approx([2.0, 0.1, 0.5, 1e-3])
    assert health[GemmOperand.DGRAD_WEIGHT].abs().sum() == 0


def test_quantizer_without_health_buffer_refuses_to_watch() -> None:
    rule = CastRule.for_role(amp8.Recipe(), TensorRole.INPUT)
    with pytest.raises(ValueError, match="no health buffer"):
        Quantizer(rule).cast(torch.randn(4, 16), watch=(GemmOperand.FPROP_INPUT,))


def _layer(recipe: amp8.Recipe) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(32, 16), recipe)


OVERRIDES = [(False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True)]


RECIPES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe(granularity="rowwise"),
    "block": amp8.Recipe(granularity="block", block_size=16),
    "mxfp8": amp8.Recipe.preset("mxfp8"),
    "nvfp4": amp8.Recipe.preset("nvfp4"),
}


@pytest.mark.parametrize("granularity", RECIPES)
@pytest.mark.parametrize("override", OVERRIDES)
def test_a_watched_step_measures_every_operand_and_changes_no_result(granularity, override) -> None:
    """Each of the six GEMM operands gets its signals (also for a GEMM in high
    precision, from the cast it would get), and watching changes neither the output nor
    the gradients, microscaled casts included."""
    recipe = RECIPES[granularity].replace(override_linear_precision=override)
    results = []
    for watch in (False, True):
        layer = _layer(recipe)
        layer.watch_health = watch
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, layer.weight.grad.float(), layer.health.clone()))
    (y0, dx0, dw0, unwatched), (y1, dx1, dw1, watched) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert unwatched.abs().sum() == 0
    assert (watched[:, Signal.AMAX] > 0).all(), watched


def test_a_token_outlier_flushes_the_other_rows_under_one_scale_but_not_per_row() -> None:
    x = torch.randn(64, 32)
    x[0] *= 2.0**22
    underflow = {}
    for granularity in ("tensorwise", "rowwise"):
        layer = _layer(amp8.Recipe(granularity=granularity))
        layer.watch_health = True
        layer(x)
        underflow[granularity] = float(layer.health[GemmOperand.FPROP_INPUT, Signal.UNDERFLOW])
    assert underflow["tensorwise"] > 0.9
    assert underflow["rowwise"] < 0.01


@pytest.mark.parametrize("n_flushed", [0, 5, 31])
def test_mxfp8_health_counts_the_values_a_block_flushes(n_flushed) -> None:
    """One E8M0 scale per 32: a value 2**-20 of its block's max falls below E4M3's
    smallest subnormal (2**-9 of the max's binade, 448) and decodes to zero."""
    x = torch.ones(4, 64)
    x[:, ::32] = 448.0  # each block's max
    x.view(-1)[1:1 + n_flushed] = 448.0 * 2.0**-20
    x[3, 40:50] = 0.0  # zeros are not counted
    cast = microscaling.quantize_mx(x, E4M3, (1, 32))
    signals = block_cast_health(x, cast)
    assert signals[Signal.AMAX] == 448.0 and signals[Signal.SATURATED] == 0
    assert signals[Signal.UNDERFLOW] == pytest.approx(n_flushed / (4 * 64 - 10))


def test_nvfp4_health_counts_blocks_whose_scale_flushed_not_small_elements() -> None:
    """NVFP4 rounds a block's values below 1/24 of its max to zero by design (E2M1's
    grid): not counted. A block whose E4M3 scale flushes under the tensor scale that an
    outlier set is: all its nonzero values are lost."""
    x = torch.ones(4, 64)
    x[:, 1:8] = 1e-3  # flushed by E2M1's grid inside healthy blocks: not counted
    healthy = block_cast_health(x, microscaling.quantize_nvfp4(x, (1, 16)))
    assert healthy[Signal.UNDERFLOW] == 0 and healthy[Signal.SATURATED] == 0
    x[0, 0] = 2.0**30  # the tensor scale follows it: every other block's scale flushes
    signals = block_cast_health(x, microscaling.quantize_nvfp4(x, (1, 16)))
    assert signals[Signal.UNDERFLOW] == pytest.approx((4 * 64 - 16) / (4 * 64))
    assert signals[Signal.SATURATED] == 0


def test_fp4_clip_limit_is_the_max_plus_half_the_top_spacing() -> None:
    """E2M1's top values are 4 and 6: 6.9 rounds to 6 anyway, 7.1 clips. Built by hand:
    one block, its decode scale 1 (block scale 1, tensor scale 1)."""
    x = torch.tensor([[6.0, 6.9, 7.1, 1.0] * 4])
    cast = microscaling.quantize_nvfp4(torch.tensor([[6.0] * 16]), (1, 16))  # decode scale 1
    cast = dataclasses.replace(cast, data=microscaling.pack_fp4(microscaling.encode_fp4(x), 1))
    assert float(cast.decode_scales().max()) == 1.0
    assert block_cast_health(x, cast)[Signal.SATURATED] == pytest.approx(4 / 16)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("spread", [1.0, 1e4])
def test_a_casts_noise_signal_gives_its_sqnr_within_a_tenth_of_a_db(recipe: str, spread: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.logspace(0, math.log10(spread), 128)
    quantizer = Quantizer(CastRule.for_role(amp8.Recipe.preset(recipe), TensorRole.INPUT), health=new_health())
    cast = quantizer.cast(x, watch=(GemmOperand.FPROP_INPUT,))
    noise = float(quantizer.health[GemmOperand.FPROP_INPUT, Signal.NOISE])
    assert sqnr_db(noise) == pytest.approx(scaling.sqnr(x, cast.dequantize()), abs=0.1)


def test_an_exact_cast_has_no_noise() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0] * 4] * 16)  # powers of two: exact in E4M3
    data = scaling.quantize(x, torch.tensor(1.0), E4M3)
    signals = cast_health(x, torch.tensor(1.0), data)
    assert float(signals[Signal.NOISE]) == 0.0 and sqnr_db(0.0) == math.inf
