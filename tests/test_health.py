"""Health signals of FP8 casts (amp8.health): exact counts on built tensors, and which
GEMM operands an Fp8Linear watches at every granularity and override."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp8
from amp8.formats import E4M3, E5M2, max_value
from amp8.health import GemmOperand, Signal, cast_health, clip_limit, new_health, record_health
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import CastRule, Quantizer, TensorRole
from amp8 import scaling


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
    record_health(health, (GemmOperand.FPROP_INPUT, GemmOperand.WGRAD_INPUT), torch.tensor([2.0, 0.1, 0.5]))
    record_health(health, (GemmOperand.FPROP_INPUT,), torch.tensor([3.0, 0.0, 0.2]))
    assert health[GemmOperand.FPROP_INPUT].tolist() == pytest.approx([3.0, 0.1, 0.5])
    assert health[GemmOperand.WGRAD_INPUT].tolist() == pytest.approx([2.0, 0.1, 0.5])
    assert health[GemmOperand.DGRAD_WEIGHT].abs().sum() == 0


def test_quantizer_without_health_buffer_refuses_to_watch() -> None:
    rule = CastRule.for_role(amp8.Recipe(), TensorRole.INPUT)
    with pytest.raises(ValueError, match="no health buffer"):
        Quantizer(rule).cast(torch.randn(4, 16), watch=(GemmOperand.FPROP_INPUT,))


def _layer(recipe: amp8.Recipe) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(32, 16), recipe)


OVERRIDES = [(False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True)]


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
@pytest.mark.parametrize("override", OVERRIDES)
def test_a_watched_step_measures_every_operand_and_changes_no_result(granularity, override) -> None:
    """Each of the six GEMM operands gets its signals (also for a GEMM in high
    precision, from the cast it would get), and watching changes neither the output nor
    the gradients."""
    recipe = amp8.Recipe(granularity=granularity, block_size=16, override_linear_precision=override)
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
