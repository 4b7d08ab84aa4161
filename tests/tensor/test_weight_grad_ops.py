"""What torch code does to gradients, done to an FP8 weight gradient (``WeightGrad``):
each result equals the same operation on the dequantized float32 gradient, within the
rounding of the gradient's format, or the operation raises a ``TypeError`` that names
the supported ones. Never a silently different value."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp8.config.formats import E4M3, E5M2
from amp8.tensor.weight_grad import GradLayout, WeightGrad

Op = Callable[..., Any]


@st.composite
def gradients(draw: st.DrawFn) -> tuple[WeightGrad, torch.Tensor]:
    """A ``WeightGrad`` (either format, any of the layouts weights take, values over many
    binades) and a plain float32 tensor of its shape."""
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([E4M3, E5M2]))
    tile = draw(st.sampled_from([None, "row", 16, 32]))
    layout = GradLayout(
        dtype,
        None if tile is None else (1, cols) if tile == "row" else (tile, tile),
        tile if isinstance(tile, int) else 0,
        draw(st.integers(0, 2)),
        draw(st.booleans()),
    )
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    binades = torch.randint(-12, 4, (rows, cols), generator=generator).float()
    real = torch.randn(rows, cols, generator=generator) * torch.exp2(binades)
    other = torch.randn(rows, cols, generator=generator)
    reported = draw(st.sampled_from([torch.float16, E4M3]))  # the Parameter dtypes of FP16 and FP8 storage
    return WeightGrad.from_float(real, layout, reported), other


def assert_within_rounding(result: WeightGrad, reference: torch.Tensor, like: WeightGrad) -> None:
    """``result`` is a gradient of ``like``'s layout and dtype whose values are
    ``reference`` rounded to its format: within half a unit in the last place where the
    scaled value is normal, half the smallest subnormal below that."""
    assert isinstance(result, WeightGrad), f"a gradient gave a {type(result).__name__}"
    assert result.grad_layout == like.grad_layout and result.dtype == like.dtype and result.shape == like.shape
    info = torch.finfo(result.grad_layout.dtype)
    scale = result.fp8.full_scale().expand(result.shape).abs()
    bound = reference.abs() * (float(info.eps) / 2 + 2.0**-20) + float(info.tiny) * float(info.eps) / 2 / scale
    error = (result.dequantize() - reference).abs()
    assert bool((error <= bound).all()), f"off by {float((error - bound).max())} beyond the format's rounding"


def _mask(other: torch.Tensor) -> torch.Tensor:
    return other > 0


OUT_OF_PLACE: dict[str, Op] = {
    "g * 0.5": lambda g, o: g * 0.5,
    "3 * g": lambda g, o: 3 * g,
    "g / 4": lambda g, o: g / 4,
    "g / -3": lambda g, o: g / -3.0,
    "torch.mul(g, 0.25)": lambda g, o: torch.mul(g, 0.25),
    "torch.div(g, 8)": lambda g, o: torch.div(g, 8),
    "g * tensor(0.5)": lambda g, o: g * torch.tensor(0.5),
    "g * other": lambda g, o: g * o,
    "g / (1 + other.abs())": lambda g, o: g / (1 + o.abs()),
    "g + other": lambda g, o: g + o,
    "g - other": lambda g, o: g - o,
    "g + g": lambda g, o: g + g,
    "1 - g": lambda g, o: 1 - g,
    "-g": lambda g, o: -g,
    "g * row": lambda g, o: g * o[:1],
    "g.abs()": lambda g, o: g.abs(),
    "torch.where": lambda g, o: torch.where(_mask(o), g, 0.0),
    "torch.where(g, other)": lambda g, o: torch.where(_mask(o), g, o),
    "clamp": lambda g, o: g.clamp(-1e-3, 1e-3),
    "clamp(min)": lambda g, o: g.clamp(min=0.0),
    "masked_fill": lambda g, o: g.masked_fill(_mask(o), 0.0),
    "nan_to_num": lambda g, o: g.nan_to_num(),
    "maximum": lambda g, o: torch.maximum(g, o * 1e-3),
    "lerp": lambda g, o: torch.lerp(g, o * 1e-3, 0.25),
    "clone": lambda g, o: g.clone(),
    "zeros_like": lambda g, o: torch.zeros_like(g),
    "to(cpu)": lambda g, o: g.to("cpu"),
}
IN_PLACE: dict[str, Op] = {
    "mul_(0.5)": lambda g, o: g.mul_(0.5),
    "div_(4)": lambda g, o: g.div_(4),
    "mul_(tensor(2))": lambda g, o: g.mul_(torch.tensor(2.0)),
    "mul_(other)": lambda g, o: g.mul_(o),
    "add_(other)": lambda g, o: g.add_(o),
    "add_(g, alpha)": lambda g, o: g.add_(g.clone(), alpha=0.5),
    "sub_(other)": lambda g, o: g.sub_(o),
    "+=": lambda g, o: g.__iadd__(g.clone()),
    "clamp_": lambda g, o: g.clamp_(-1e-3, 1e-3),
    "masked_fill_": lambda g, o: g.masked_fill_(_mask(o), 0.0),
    "copy_(other)": lambda g, o: g.copy_(o),
    "copy_(gradient)": lambda g, o: g.copy_(g.clone() * 2),
    "zero_": lambda g, o: g.zero_(),
    "fill_": lambda g, o: g.fill_(0.125),
    "_foreach_mul_": lambda g, o: torch._foreach_mul_([g], torch.tensor(0.5)),
    "_foreach_div_": lambda g, o: torch._foreach_div_([g], 3.0),
    "_foreach_add_": lambda g, o: torch._foreach_add_([g], [o]),
    "_foreach_zero_": lambda g, o: torch._foreach_zero_([g]),
}
READS: dict[str, Op] = {
    "sum": lambda g, o: g.sum(),
    "sum(dim)": lambda g, o: g.sum(dim=0),
    "mean": lambda g, o: g.mean(),
    "norm": lambda g, o: g.norm(),
    "vector_norm(inf)": lambda g, o: torch.linalg.vector_norm(g, float("inf")),
    "amax": lambda g, o: g.abs().amax(),
    "max": lambda g, o: g.max(),
    "isfinite": lambda g, o: g.isfinite(),
    "g > 0": lambda g, o: g > 0,
    "eq": lambda g, o: g == g,
    "float()": lambda g, o: g.float(),
    "to(float64)": lambda g, o: g.to(torch.float64),
    "to(bfloat16)": lambda g, o: g.to(torch.bfloat16),
    "_foreach_norm": lambda g, o: torch._foreach_norm([g, o]),
    "_foreach_norm(inf)": lambda g, o: torch._foreach_norm([g], float("inf")),
}
UNSUPPORTED: dict[str, Op] = {
    "view": lambda g, o: g.view(-1),
    "reshape": lambda g, o: g.reshape(-1),
    "t": lambda g, o: g.t(),
    "matmul": lambda g, o: torch.matmul(g, o.t()),
    "cat": lambda g, o: torch.cat([g, o]),
    "index": lambda g, o: g[0],
    "cumsum": lambda g, o: g.cumsum(0),
    "_foreach_sqrt": lambda g, o: torch._foreach_sqrt([g]),
    "add_ into a plain tensor": lambda g, o: o.add_(g),
    "lerp_ into a plain tensor": lambda g, o: o.lerp_(g, 0.1),
}
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reference(op: Op, grad: WeightGrad, other: torch.Tensor) -> Any:
    """``op`` applied to the real values: plain float32 tensors in place of gradients."""
    return op(grad.dequantize(), other.clone())


@pytest.mark.parametrize("name", list(OUT_OF_PLACE))
@EXAMPLES
@given(case=gradients())
def test_out_of_place_ops_give_a_gradient_of_the_real_result(name: str, case: tuple[WeightGrad, torch.Tensor]) -> None:
    grad, other = case
    before = grad.dequantize()
    result = OUT_OF_PLACE[name](grad, other)
    assert_within_rounding(result, _reference(OUT_OF_PLACE[name], grad, other), grad)
    torch.testing.assert_close(grad.dequantize(), before, atol=0, rtol=0, msg="the operand changed")


@pytest.mark.parametrize("name", list(IN_PLACE))
@EXAMPLES
@given(case=gradients())
def test_in_place_ops_store_the_real_result(name: str, case: tuple[WeightGrad, torch.Tensor]) -> None:
    grad, other = case
    reference = grad.dequantize()
    IN_PLACE[name](reference, other.clone())
    data, scale = grad.fp8.data, grad.fp8.scale
    IN_PLACE[name](grad, other)
    assert_within_rounding(grad, reference, grad)
    assert grad.fp8.data is data and grad.fp8.scale is scale, "an in-place operation replaced the gradient's tensors"


@pytest.mark.parametrize("name", list(READS))
@EXAMPLES
@given(case=gradients())
def test_reads_see_the_real_values_exactly(name: str, case: tuple[WeightGrad, torch.Tensor]) -> None:
    grad, other = case
    result = READS[name](grad, other)
    expected = _reference(READS[name], grad, other)
    results, expected = (result, expected) if isinstance(result, tuple) else ((result,), (expected,))
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        assert type(got) is torch.Tensor, f"a read gave a {type(got).__name__}"
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
@settings(max_examples=3, deadline=None)
@given(case=gradients())
def test_other_ops_raise_naming_the_supported_ones(name: str, case: tuple[WeightGrad, torch.Tensor]) -> None:
    grad, other = case
    before = other.clone()
    with pytest.raises(TypeError, match=r"amp8: .*(Supported: elementwise|amp8\.initialize returns)"):
        UNSUPPORTED[name](grad, other)
    torch.testing.assert_close(other, before, atol=0, rtol=0, msg="a refused operation changed its operand")


@pytest.mark.parametrize("factor", [0.5, 3.0, -0.25, 1e-3])
def test_scaling_by_a_scalar_is_exact(factor: float) -> None:
    """Out of place and in place alike, only the scales change: the FP8 bytes stay and
    the real values are the exact products."""
    layout = GradLayout(E4M3, (1, 8), 0)
    grad = WeightGrad.from_float(torch.randn(4, 8), layout, torch.float16)
    real = grad.dequantize()
    for scaled in (grad * factor, factor * grad, torch.mul(grad, factor), grad / (1 / factor), grad.clone().mul_(factor)):
        assert torch.equal(scaled.fp8.data.view(torch.uint8), grad.fp8.data.view(torch.uint8))
        torch.testing.assert_close(scaled.dequantize(), real * factor, atol=0, rtol=2**-21)  # float32 rounding of the scale
