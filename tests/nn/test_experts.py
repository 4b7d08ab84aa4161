"""Fp8Experts: the routing, its GEMMs against Fp8Linear's and FP32, recognition of experts
modules by structure, and the module swap. CPU only, no transformers (tests/moe_models.py
holds an experts module with transformers' layout)."""

import copy

import pytest
import torch
from torch import nn

import amp8
from amp8 import Recipe
from amp8.config.levels import Precision
from amp8.nn import ExpertsLayout, Fp8Experts, Fp8Linear, swap_experts, swap_linear_layers
from amp8.nn.experts import Routing
from amp8.nn.experts_function import _Fp8ExpertsFunction
from amp8.nn.experts_layout import experts_layout
from amp8.nn.gemm_config import LinearGemmConfig
from amp8.ops.grouped_gemm import ExpertGroups
from conftest import assert_bitwise_equal, assert_sqnr_at_least
from moe_models import TinyExperts, TinyMoeBlock, routing

RECIPES = {
    "tensorwise": Recipe(),
    "e4m3": Recipe(fp8_format="E4M3"),
    "delayed": Recipe(scaling="delayed"),
    "rowwise": Recipe.preset("rowwise"),
    "deepseek": Recipe.preset("deepseek"),
    "mxfp8": Recipe.preset("mxfp8"),
    "fp8-activations": Recipe.preset("rowwise").replace(activations="fp8"),
    "block": Recipe(granularity="block", block_size=32),
}
# (tokens, experts, top_k, experts no token is routed to)
ROUTINGS = {
    "spread": (48, 4, 2, ()), "empty expert": (24, 4, 2, (1,)),
    "one token": (1, 8, 2, ()), "top-1": (40, 16, 1, (0, 5)),
}


def test_routing_puts_each_pair_in_its_experts_padded_group() -> None:
    index = torch.tensor([[2, 0], [2, 3], [0, 2], [4, -1]])  # 4 and -1: routed to no expert (E = 4)
    routed = Routing.from_indices(index, 4)
    assert routed.groups == ExpertGroups((2, 0, 3, 1))
    starts = routed.groups.starts  # (0, 16, 16, 32)
    expected_rows = [starts[2], starts[0], starts[2] + 1, starts[3], starts[0] + 1, starts[2] + 2, 48, 48]
    assert routed.rows.tolist() == expected_rows
    tokens = 4  # padding rows copy the zero row past the last token
    expected = torch.full((48,), tokens)
    expected[[0, 1, 16, 17, 18, 32]] = torch.tensor([0, 2, 0, 1, 2, 1])
    assert routed.source.tolist() == expected.tolist()


def _config(recipe: Recipe, k: int, n: int) -> LinearGemmConfig:
    return LinearGemmConfig.build(recipe, k, n, fp8_wgrad=False, update_history=False, out_dtype=torch.float32)


@pytest.mark.parametrize("counts", [(5, 0, 37, 16), (1, 64), (0, 0, 20)])
@pytest.mark.parametrize("recipe_name", [*RECIPES, "nvfp4"])
def test_each_experts_gemms_are_an_fp8_linears_on_its_tokens_bit_for_bit(counts, recipe_name) -> None:
    recipe = Recipe.preset("nvfp4") if recipe_name == "nvfp4" else RECIPES[recipe_name]
    groups = ExpertGroups(counts)
    k, n = 32, 64
    holder = TinyExperts(len(counts), k, n // 2)
    module = Fp8Experts.from_module(holder, recipe)
    weight = holder.gate_up_proj  # (E, 2I, H) = (E, N, K)
    x, g = torch.zeros(groups.rows, k), torch.zeros(groups.rows, n)
    for e in groups.active:
        x[groups.group(e)][: counts[e]] = torch.randn(counts[e], k)
        g[groups.group(e)][: counts[e]] = torch.randn(counts[e], n)
    x.requires_grad_(True)
    y = _Fp8ExpertsFunction.apply(x, weight, None, groups, module.quantizers(), _config(module.recipe, k, n))
    y.backward(g)
    for e in groups.active:
        linear = nn.Linear(k, n, bias=False)
        linear.weight = nn.Parameter(weight.detach()[e].clone())
        layer = Fp8Linear.from_linear(linear, module.recipe, Precision.AS_IS)
        # The expert's tokens with its padding rows (zeros): the CPU's GEMM kernels sum a
        # single row in another order than a matrix.
        rows = groups.group(e)
        x_e = x.detach()[rows].clone().requires_grad_(True)
        y_e = layer(x_e)
        y_e.backward(g[rows])
        assert_bitwise_equal(y[rows], y_e)
        assert_bitwise_equal(x.grad[rows], x_e.grad)
        assert_bitwise_equal(weight.grad[e], layer.weight.grad)
    for e in set(range(len(counts))) - set(groups.active):
        assert not weight.grad[e].any(), "an expert without tokens gets a zero gradient"


def _run(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = module(x, index, weights)
    y.backward(grad)
    return y, x.grad


@pytest.mark.parametrize("routed", list(ROUTINGS.values()), ids=list(ROUTINGS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_experts_output_and_gradients_against_fp32(routed, recipe_name) -> None:
    tokens, num_experts, top_k, unused = routed
    reference = TinyExperts(num_experts, 64, 32)
    module = Fp8Experts.from_module(copy.deepcopy(reference), RECIPES[recipe_name])
    index, weights = routing(tokens, num_experts, top_k, unused)
    x, grad = torch.randn(tokens, 64), torch.randn(tokens, 64)
    y_ref, gx_ref = _run(reference, x, index, weights, grad)
    y, gx = _run(module, x, index, weights, grad)
    assert y.shape == y_ref.shape and y.dtype == x.dtype
    # Fp8Linear's floors (tests/nn/test_linear.py): output 18 dB, input and weight gradients 17.
    assert_sqnr_at_least(y_ref, y, 18.0)
    assert_sqnr_at_least(gx_ref, gx, 17.0)
    for name in ("gate_up_proj", "down_proj"):
        grad_ref, grad_fp8 = getattr(reference, name).grad, getattr(module, name).grad
        assert grad_fp8.dtype == torch.float32, "a plain gradient in the Parameter's dtype"
        used = sorted(set(index.flatten().tolist()))
        assert_sqnr_at_least(grad_ref[used], grad_fp8[used], 17.0)
        assert not grad_fp8[[e for e in range(num_experts) if e not in used]].any()


def test_nvfp4_projection_holds_fp8_linears_nvfp4_floors() -> None:
    # One projection, as one NVFP4 Fp8Linear (tests/ops/test_blackwell.py: 14, 12, 13 dB);
    # both in a row compound two FP4 GEMMs' errors, so the floors are per projection.
    groups = ExpertGroups((40, 0, 64))
    holder = TinyExperts(3, 64, 64)
    module = Fp8Experts.from_module(holder, Recipe.preset("nvfp4"))
    x, g = torch.randn(groups.rows, 64, requires_grad=True), torch.randn(groups.rows, 128)
    config = _config(module.recipe, 64, 128)
    y = _Fp8ExpertsFunction.apply(x, holder.gate_up_proj, None, groups, module.quantizers(), config)
    y.backward(g)
    for e in groups.active:
        rows, w = groups.group(e), holder.gate_up_proj.detach()[e]
        assert_sqnr_at_least(x.detach()[rows] @ w.t(), y.detach()[rows], 14.0)
        assert_sqnr_at_least(g[rows] @ w, x.grad[rows], 12.0)
        assert_sqnr_at_least(g[rows].t() @ x.detach()[rows], holder.gate_up_proj.grad[e], 13.0)


def test_no_tokens_and_retained_graphs() -> None:
    module = Fp8Experts.from_module(TinyExperts(), Recipe())
    x = torch.randn(0, 32, requires_grad=True)
    y = module(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    y.sum().backward()
    assert y.shape == (0, 32) and not module.gate_up_proj.grad.any()
    module.zero_grad()
    index, weights = routing(20, 4)
    y = module(torch.randn(20, 32), index, weights)
    y.sum().backward(retain_graph=True)
    once = module.down_proj.grad.clone()
    y.sum().backward()  # the FP8 weights were kept for a second backward
    assert_bitwise_equal(module.down_proj.grad, 2 * once)


def test_from_module_reuses_the_parameters_and_to_module_gives_the_module_back() -> None:
    experts = TinyExperts()
    keys = list(experts.state_dict())
    module = Fp8Experts.from_module(experts, Recipe())
    assert module.gate_up_proj is experts.gate_up_proj and module.down_proj is experts.down_proj
    assert list(module.state_dict()) == keys, "the plain form has the replaced module's keys"
    with amp8.compact_state_dict(module):
        assert list(module.state_dict()) == [*keys, *(f"{key}_scale" for key in keys)], (
            "compact checkpoints keep the Parameters' keys, and add their scales"
        )
    copied = copy.deepcopy(module)
    back = copied.to_module()
    assert type(back) is TinyExperts and back.gate_up_proj is copied.gate_up_proj
    index, weights = routing(8, 4)
    x = torch.randn(8, 32)
    assert_sqnr_at_least(back(x, index, weights), copied(x, index, weights), 18.0)


@pytest.mark.parametrize("storage", [Precision.FP16, Precision.FP8])
@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise", "block"])
def test_stored_experts_compute_from_their_real_weights_and_return_fp8_gradients(storage, recipe_name) -> None:
    """Stored experts (the weights of O1-O3) give the output and input gradient that the
    same real weights give unstored, bit for bit, and as weight gradient that one's
    float gradient quantized at the stored weight's layout: each expert's own scales."""
    recipe = RECIPES[recipe_name]
    # (4, 32, 64) and (4, 64, 16) weights: in 32 x 32 blocks, one block of rows and two of columns
    stored = Fp8Experts.from_module(TinyExperts(4, 64, 16), recipe, storage)
    plain = Fp8Experts.from_module(TinyExperts(4, 64, 16), recipe)
    with torch.no_grad():
        for handle, param in zip(stored.stored_weights(), (plain.gate_up_proj, plain.down_proj)):
            param.copy_(handle.read())
    index, weights = routing(24, 4, unused=(2,))
    x, grad = torch.randn(24, 64), torch.randn(24, 64)
    y, x_grad = _run(stored, x, index, weights, grad)
    y_plain, x_grad_plain = _run(plain, x, index, weights, grad)
    assert_bitwise_equal(y, y_plain)
    assert_bitwise_equal(x_grad, x_grad_plain)
    for handle, param in zip(stored.stored_weights(), (plain.gate_up_proj, plain.down_proj)):
        assert handle.data.dtype == {Precision.FP16: torch.float16, Precision.FP8: torch.float8_e4m3fn}[storage]
        assert handle.param.dtype == torch.float32, "the Parameter reports the model's dtype"
        fp8 = handle.grad()
        expected = handle.grad_layout.quantize(param.grad)
        assert_bitwise_equal(fp8.data, expected.data)
        assert_bitwise_equal(fp8.scale, expected.scale)
        assert fp8.scale.shape[0] == 4, "one scale per expert at least"
        assert not fp8.dequantize()[2].any(), "an expert without tokens gets a zero gradient"


class _Renamed(nn.Module):
    """Experts under other names, declared through the protocol."""

    amp8_experts_layout = ExpertsLayout(gate_up="w13", down="w2", activation="act")

    def __init__(self) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(4, 32, 32) / 6)
        self.w2 = nn.Parameter(torch.randn(4, 32, 16) / 4)
        self.act = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        reference = TinyExperts(4, 32, 16)
        reference.gate_up_proj, reference.down_proj, reference.act_fn = self.w13, self.w2, self.act
        return reference(hidden_states, top_k_index, top_k_weights)


def test_other_layouts_take_part_through_the_protocol() -> None:
    experts = _Renamed()
    assert experts_layout(experts) == _Renamed.amp8_experts_layout
    module = Fp8Experts.from_module(copy.deepcopy(experts), Recipe())
    index, weights = routing(16, 4)
    x = torch.randn(16, 32)
    with amp8.compact_state_dict(module):
        assert list(module.state_dict()) == ["w13", "w2", "w13_scale", "w2_scale"]
    assert_sqnr_at_least(experts(x, index, weights), module(x, index, weights), 18.0)


def _unsupported(case: str) -> nn.Module:
    experts = TinyExperts()
    if case == "bias":
        experts.has_bias = True
    elif case == "transposed":
        experts.is_transposed = True
    elif case == "odd sizes":
        experts.gate_up_proj = nn.Parameter(torch.randn(4, 20, 32))
        experts.down_proj = nn.Parameter(torch.randn(4, 32, 10))
    elif case == "extra parameter":
        experts.scale = nn.Parameter(torch.ones(4))
    elif case == "no activation":
        experts.act_fn = None
    elif case == "shapes":
        experts.down_proj = nn.Parameter(torch.randn(4, 16, 32))
    return experts


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bias", "has_bias=True"), ("transposed", "is_transposed=True"), ("odd sizes", "intermediate size I=10"),
        ("extra parameter", "holds scale besides"), ("no activation", "neither"), ("shapes", r"\(E, 2I, H\)"),
    ],
)
def test_experts_amp8_cannot_run_are_refused_naming_why(case: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8Experts.from_module(_unsupported(case), Recipe())


def test_a_forward_of_another_signature_is_refused() -> None:
    class Other(TinyExperts):
        def forward(self, x, routing_weights):  # type: ignore[override]
            return x

    with pytest.raises(ValueError, match="its forward takes"):
        Fp8Experts.from_module(Other(), Recipe())


def test_a_declared_layout_must_be_an_experts_layout() -> None:
    experts = TinyExperts()
    experts.amp8_experts_layout = {"gate_up": "gate_up_proj"}
    with pytest.raises(TypeError, match="ExpertsLayout"):
        experts_layout(experts)


def test_swap_replaces_experts_warns_for_those_it_keeps_and_leaves_routers_high() -> None:
    model = nn.Sequential(TinyMoeBlock(), TinyMoeBlock())
    model[1].experts.has_bias = True
    with pytest.warns(UserWarning, match=r"'1.experts' \(TinyExperts\) stay in high precision: has_bias=True"):
        kept = swap_experts(model, lambda experts: Fp8Experts.from_module(experts, Recipe()))
    assert isinstance(model[0].experts, Fp8Experts) and type(model[1].experts) is TinyExperts
    assert kept == {"1.experts": "has_bias=True"}
    kept = swap_linear_layers(model, lambda linear: Fp8Linear.from_linear(linear, Recipe()))
    assert type(model[0].gate) is nn.Linear and "router of the experts '0.experts'" in kept["0.gate"]


def test_swap_honours_the_filter_and_the_recipes_patterns() -> None:
    model = nn.Sequential(TinyMoeBlock(), TinyMoeBlock())
    kept = swap_experts(
        model, lambda experts: Fp8Experts.from_module(experts, Recipe()),
        module_filter=lambda module, fqn: not fqn.startswith("0."), high_precision_layers=("1.*",),
    )
    assert kept == {
        "0.experts": "excluded by module_filter", "1.experts": "matches Recipe.high_precision_layers pattern '1.*'",
    }
