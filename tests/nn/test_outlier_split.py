"""wgrad's outlier split (``Recipe.wgrad_outlier_split``): the tokens that set wgrad's
scales along tokens are multiplied in float32, the rest in FP8."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amp8
from amp8.nn.linear import Fp8Linear
from amp8.nn.outlier_split import OUTLIER_ROW_RATIO, split_outlier_tokens, token_share

GAIN = 2.0**20


def _sqnr_db(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.square().sum() / (value - reference).square().sum()))


def _operands(m: int, k: int, n: int, every: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An input (M, K) whose every ``every``-th token row is an outlier, and an output
    gradient (M, N) that is zero on those rows (their loss is ignored)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.gelu(torch.randn(m, k, generator=generator))
    x[::every] *= GAIN
    g = torch.randn(m, n, generator=generator)
    g[::every] = 0
    return x, g


@pytest.mark.parametrize(("m", "k", "n"), [(64, 32, 16), (200, 48, 80), (1024, 128, 64)])
@pytest.mark.parametrize("operand", ["input", "grad_output"])
def test_the_split_takes_out_the_outlier_rows_and_keeps_the_product(m, k, n, operand) -> None:
    generator = torch.Generator().manual_seed(1)
    x, g = torch.randn(m, k, generator=generator), torch.randn(m, n, generator=generator)
    rows = torch.tensor([0, m // 2, m - 1])
    (x if operand == "input" else g)[rows] *= GAIN
    share = 3 / m
    outliers, x_rest, g_rest = split_outlier_tokens(x, g, token_share(share))
    assert torch.equal(outliers, g[rows].t() @ x[rows]), "the outliers' product, in float32"
    for rest, whole in ((x_rest, x), (g_rest, g)):
        assert torch.equal(rest[rows], torch.zeros_like(rest[rows]))
        kept = torch.ones(m, dtype=torch.bool)
        kept[rows] = False
        assert torch.equal(rest[kept], whole[kept])
    torch.testing.assert_close(outliers + g_rest.t() @ x_rest, g.t() @ x, rtol=1e-5, atol=1e-3 * GAIN)


def _taken(x_rest: torch.Tensor) -> torch.Tensor:
    """The indices of the rows the split zeroed."""
    return (x_rest == 0).all(1).nonzero().flatten()


@pytest.mark.parametrize("m", [256, 512, 1000])
@pytest.mark.parametrize("outlier_share", [1 / 64, 1 / 16, 1 / 4])
@pytest.mark.parametrize("operand", ["input", "grad_output"])
def test_the_split_takes_as_many_rows_as_there_are_outliers(m, outlier_share, operand) -> None:
    """With the cap at 1/4 of the tokens, the split takes exactly the outlier rows at
    1/64, 1/16 and 1/4 of them, and no other row."""
    generator = torch.Generator().manual_seed(3)
    x, g = torch.randn(m, 48, generator=generator), torch.randn(m, 24, generator=generator)
    rows = torch.arange(0, m, round(1 / outlier_share))[: math.ceil(m / 4)]
    (x if operand == "input" else g)[rows] *= 2 * OUTLIER_ROW_RATIO
    outliers, x_rest, g_rest = split_outlier_tokens(x, g, token_share(1 / 4))
    assert torch.equal(_taken(x_rest), rows) and torch.equal(_taken(g_rest), rows)
    # The same float32 sums, over a window with zeroed rows besides the outliers'.
    torch.testing.assert_close(outliers, g[rows].t() @ x[rows], rtol=1e-6, atol=1e-6 * float(outliers.abs().max()))


@pytest.mark.parametrize(("cap", "m"), [(1 / 4, 256), (1 / 8, 256), (1 / 32, 100)])
def test_beyond_the_cap_the_split_takes_the_largest_outliers(cap, m) -> None:
    x, g = torch.randn(m, 16), torch.randn(m, 16)
    gains = torch.linspace(2 * OUTLIER_ROW_RATIO, 2**20, m // 2)
    x[::2] = gains[:, None] * x[::2].sign()  # every other row an outlier of amax ``gain``, the later ones larger
    _, x_rest, _ = split_outlier_tokens(x, g, token_share(cap))
    count = math.ceil(cap * m)
    assert torch.equal(_taken(x_rest), torch.arange(0, m, 2)[-count:]), "the cap's count, largest first"


def test_without_outliers_the_split_takes_nothing() -> None:
    x, g = torch.randn(256, 32), torch.randn(256, 16)
    x[::16] *= OUTLIER_ROW_RATIO / 4  # large rows, but not outliers
    g[: 200] = 0  # most tokens left out of the loss: the median is of the rows that are not zero
    outliers, x_rest, g_rest = split_outlier_tokens(x, g, token_share(1 / 4))
    assert torch.equal(x_rest, x) and torch.equal(g_rest, g)
    assert torch.equal(outliers, torch.zeros(16, 32))


@pytest.mark.parametrize("m", [0, 1, 5])
def test_an_empty_or_zero_batch_splits_nothing(m) -> None:
    x, g = torch.zeros(m, 8), torch.zeros(m, 4)
    outliers, x_rest, g_rest = split_outlier_tokens(x, g, token_share(1 / 4))
    assert torch.equal(outliers, torch.zeros(4, 8)) and x_rest.shape == (m, 8) and g_rest.shape == (m, 4)


@pytest.mark.parametrize("recipe", [
    amp8.Recipe.preset("rowwise"), amp8.Recipe.preset("deepseek"), amp8.Recipe(granularity="rowwise"),
    amp8.Recipe.preset("mxfp8"),
], ids=["rowwise", "deepseek", "hybrid-rowwise", "mxfp8"])
@pytest.mark.parametrize(("m", "k", "n"), [(512, 256, 128), (256, 64, 96)])
def test_token_outliers_leave_wgrad_dark_and_the_split_restores_it(recipe, m, k, n) -> None:
    x, g = _operands(m, k, n, every=64)
    reference = g.t() @ x
    sqnr = {}
    for split in (False, True):
        torch.manual_seed(0)
        layer = Fp8Linear.from_linear(nn.Linear(k, n, bias=False), recipe.replace(wgrad_outlier_split=split))
        layer(x.clone().requires_grad_()).backward(g)
        sqnr[split] = _sqnr_db(layer.weight.grad.dequantize(), reference)
    assert sqnr[False] < 10, f"the outliers flush wgrad's other tokens: {sqnr}"
    assert sqnr[True] > 20, f"split off, the rest casts well: {sqnr}"


@pytest.mark.parametrize("recipe", [amp8.Recipe.preset("rowwise"), amp8.Recipe.preset("deepseek")],
                         ids=["rowwise", "deepseek"])
def test_without_outliers_the_split_costs_no_accuracy(recipe) -> None:
    generator = torch.Generator().manual_seed(2)
    x, g = torch.randn(256, 64, generator=generator), torch.randn(256, 32, generator=generator)
    reference = g.t() @ x
    sqnr = {}
    for split in (False, True):
        torch.manual_seed(0)
        layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=False), recipe.replace(wgrad_outlier_split=split))
        layer(x.clone().requires_grad_()).backward(g)
        sqnr[split] = _sqnr_db(layer.weight.grad.dequantize(), reference)
    assert sqnr[True] >= sqnr[False] - 0.5, sqnr


@pytest.mark.parametrize(("changes", "match"), [
    ({"wgrad_outlier_split": True}, "needs scales along tokens"),
    ({"granularity": "rowwise", "wgrad_outlier_split": 1}, "wgrad_outlier_split=1 is not valid"),
    ({"wgrad_outlier_share": 0.0}, r"wgrad_outlier_share=0.0 is not valid; use a share of tokens in \(0, 0.5\]"),
    ({"wgrad_outlier_share": 0.75}, "wgrad_outlier_share=0.75 is not valid"),
    ({"wgrad_outlier_share": True}, "wgrad_outlier_share=True is not valid"),
])
def test_bad_split_settings_name_the_field_and_the_fix(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        amp8.Recipe(**changes)


def test_the_layer_says_it_splits_and_stores_it() -> None:
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(32, 32)), None, "O1",
                               recipe=amp8.Recipe.preset("rowwise").replace(wgrad_outlier_split=True))
    assert model[0].gemm_description == "rowwise, wgrad outliers high"
    assert model[0].gemm_precision.tolist() == [1, 0, 0, 2]
    model[0].set_gemm_precision("block", (False, False, True), outlier_split=True)
    assert model[0].gemm_description == "block, wgrad high", "the whole of wgrad high covers its outliers"
    assert model[0].gemm_precision.tolist() == [2, 0, 0, 1]


@pytest.mark.compile
def test_a_compiled_split_equals_eager() -> None:
    recipe = amp8.Recipe.preset("rowwise").replace(wgrad_outlier_split=True)
    x, g = _operands(256, 64, 32, every=64)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = Fp8Linear.from_linear(nn.Linear(64, 32), recipe)
        run = torch.compile(layer) if compiled else layer
        run(x.clone().requires_grad_()).backward(g)
        grads.append(layer.weight.grad.dequantize())
    assert torch.equal(grads[0], grads[1])
