"""The grouped FP8 GEMMs of MoE experts: per-expert dense FP8 GEMMs on the CPU, bit for
bit, and the arguments of CUDA's grouped kernel, checked and emulated on the CPU."""

import pytest
import torch

from amp8 import Recipe, _compat
from amp8.config.formats import E5M2
from amp8.config.gemms import Gemm
from amp8.nn.quantizer import CastRule, Quantizer, TensorRole
from amp8.ops.gemm import fp8_gemm
from amp8.ops.grouped_gemm import (
    ExpertGroups, check_grouped_operands, grouped_fp8_gemm, grouped_fp8_wgrad, grouped_kernel_arguments,
    grouped_kernel_takes,
)
from amp8.quant.scale_layout import GEMM_ALIGNMENT
from conftest import assert_bitwise_equal, assert_sqnr_at_least, cuda_fp8

# Tokens per expert: even, one expert without tokens, very uneven, none at all but one.
COUNTS = {"even": (16, 16, 16), "empty expert": (5, 0, 37, 16), "uneven": (1, 90, 0, 0, 3), "one expert": (0, 0, 33)}
RECIPES = {
    "tensorwise": Recipe(),
    "rowwise": Recipe.preset("rowwise"),
    "block": Recipe.preset("deepseek").replace(block_size=16),
    "mxfp8": Recipe.preset("mxfp8"),
}
K, N = 32, 48


def _quantizer(recipe: Recipe, role: TensorRole) -> Quantizer:
    return Quantizer(CastRule.for_role(recipe, role))


def _tokens(groups: ExpertGroups, width: int) -> torch.Tensor:
    """A (rows, width) token matrix: random real rows, zero padding rows."""
    x = torch.zeros(groups.rows, width)
    for expert in groups.active:
        x[groups.group(expert)][: groups.counts[expert]] = torch.randn(groups.counts[expert], width)
    return x


def _per_expert(groups: ExpertGroups, cast) -> list:
    return [cast(expert) if expert in groups.active else None for expert in range(groups.num_experts)]


def test_expert_groups_pad_each_group_to_the_alignment() -> None:
    groups = ExpertGroups((5, 0, 37, 16))
    assert groups.sizes == (16, 0, 48, 16) and groups.starts == (0, 16, 16, 64) and groups.rows == 80
    assert groups.active == (0, 2, 3) and groups.group(2) == slice(16, 64)
    assert groups.offsets(torch.device("cpu")).tolist() == [16, 16, 64, 80]
    assert ExpertGroups.from_counts(torch.tensor([5, 0, 37, 16])) == groups


@pytest.mark.parametrize("counts", [(), (1, -1), (1.5,), (True,)])
def test_expert_groups_refuse_counts_that_are_not_token_counts(counts) -> None:
    with pytest.raises(ValueError, match="one int >= 0 per expert"):
        ExpertGroups(counts)


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("role", [Gemm.FPROP, Gemm.DGRAD])
def test_grouped_gemm_is_each_experts_dense_fp8_gemm_bit_for_bit(counts, recipe_name, role) -> None:
    recipe = RECIPES[recipe_name]
    groups = ExpertGroups(counts)
    a_role = TensorRole.INPUT if role is Gemm.FPROP else TensorRole.GRAD_OUTPUT  # E5M2 under HYBRID
    x, weights = _tokens(groups, K), torch.randn(groups.num_experts, N, K)
    a = _per_expert(groups, lambda e: _quantizer(recipe, a_role).cast(x[groups.group(e)]))
    b = _per_expert(groups, lambda e: _quantizer(recipe, TensorRole.WEIGHT).cast(weights[e]).t())
    out = grouped_fp8_gemm(a, b, groups, N, torch.float32, role)
    assert out.shape == (groups.rows, N)
    for expert in range(groups.num_experts):
        if expert not in groups.active:
            continue
        rows = x[groups.group(expert)].clone()  # the expert's tokens alone, as a dense layer gets them
        w8 = _quantizer(recipe, TensorRole.WEIGHT).cast(weights[expert].clone())
        dense = fp8_gemm(_quantizer(recipe, a_role).cast(rows), w8.t(), torch.float32, role)
        assert_bitwise_equal(out[groups.group(expert)], dense)
        assert not out[groups.group(expert)][groups.counts[expert]:].any(), "padding rows stay zero"
    assert_sqnr_at_least(_reference_rows(x, weights, groups), out, _floor(a))


def _floor(operands: list) -> float:
    """DESIGN.md's 25 dB for one FP8 GEMM; 22 dB with an E5M2 operand (tests/ops/test_gemm.py)."""
    return 22.0 if any(part is not None and part.dtype == E5M2 for part in operands) else 25.0


def _reference_rows(x: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    out = torch.zeros(groups.rows, weights.shape[1])
    for expert in groups.active:
        out[groups.group(expert)] = x[groups.group(expert)] @ weights[expert].t()
    return out


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_grouped_wgrad_is_each_experts_dense_fp8_gemm_bit_for_bit(counts, recipe_name) -> None:
    recipe = RECIPES[recipe_name]
    groups = ExpertGroups(counts)
    g, x = _tokens(groups, N), _tokens(groups, K)
    grad = _quantizer(recipe, TensorRole.GRAD_OUTPUT)
    inputs = _quantizer(recipe, TensorRole.INPUT)
    a = _per_expert(groups, lambda e: grad.cast(g[groups.group(e)], 0).t())
    b = _per_expert(groups, lambda e: inputs.cast(x[groups.group(e)], 0))
    out = grouped_fp8_wgrad(
        [None if p is None else p.with_data(p.data.contiguous()) for p in a],
        [None if p is None else p.with_data(p.data.t().contiguous().t()) for p in b],
        groups, (N, K),
    )
    assert out.shape == (groups.num_experts, N, K)
    for expert in range(groups.num_experts):
        if expert not in groups.active:
            assert not out[expert].any(), "an expert without tokens has a zero gradient"
            continue
        g_t, x_e = grad.cast(g[groups.group(expert)].clone(), 0).t(), inputs.cast(x[groups.group(expert)].clone(), 0)
        g_t, x_e = g_t.with_data(g_t.data.contiguous()), x_e.with_data(x_e.data.t().contiguous().t())
        dense = fp8_gemm(g_t, x_e, torch.float32, Gemm.WGRAD)
        assert_bitwise_equal(out[expert], dense)
        assert_sqnr_at_least(g[groups.group(expert)].t() @ x[groups.group(expert)], out[expert], _floor(a))


def test_operands_must_match_the_experts_with_tokens() -> None:
    groups = ExpertGroups((16, 0))
    x8 = _quantizer(Recipe(), TensorRole.INPUT).cast(torch.randn(16, K))
    w8 = _quantizer(Recipe(), TensorRole.WEIGHT).cast(torch.randn(N, K)).t()
    with pytest.raises(ValueError, match="one operand per expert"):
        grouped_fp8_gemm([x8], [w8], groups, N, torch.float32, Gemm.FPROP)
    with pytest.raises(ValueError, match=r"experts with tokens are \[0\]"):
        grouped_fp8_gemm([x8, x8], [w8, w8], groups, N, torch.float32, Gemm.FPROP)


def test_no_tokens_at_all_gives_empty_rows_and_zero_gradients() -> None:
    groups = ExpertGroups((0, 0, 0))
    assert grouped_fp8_gemm([None] * 3, [None] * 3, groups, N, torch.float32, Gemm.FPROP).shape == (0, N)
    wgrad = grouped_fp8_wgrad([None] * 3, [None] * 3, groups, (N, K))
    assert wgrad.shape == (3, N, K) and not wgrad.any()


# -- torch's grouped FP8 kernel (CUDA sm_90 / sm_100): its arguments, on every device ------

def _emulated_grouped_kernel(mat_a, mat_b, scale_a, scale_b, offs, contraction: bool) -> torch.Tensor:
    """What ``torch._scaled_grouped_mm`` computes (decode scales, float32 products, one
    rounding to bfloat16), group by group, as the CPU's dense kernel sums."""
    starts = [0, *offs.tolist()[:-1]]
    blocks = []
    for index, (start, end) in enumerate(zip(starts, offs.tolist())):
        if contraction:
            n, k = mat_a.shape[0], mat_b.shape[1]
            a = mat_a[:, start:end].float() * scale_a[index * n:(index + 1) * n, None]
            b = mat_b[start:end].contiguous().float() * scale_b[index * k:(index + 1) * k]
            blocks.append((a @ b).to(torch.bfloat16))
        else:
            a = mat_a[start:end].float() * scale_a[start:end, None]
            blocks.append(((a @ (mat_b[index].contiguous().float() * scale_b[index])).to(torch.bfloat16)))
    return torch.stack(blocks) if contraction else torch.cat(blocks)


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("recipe_name", ["tensorwise-e4m3", "rowwise"])
def test_grouped_kernel_arguments_pass_its_checks_and_give_the_dense_results(counts, recipe_name) -> None:
    recipe = Recipe(fp8_format="E4M3") if recipe_name == "tensorwise-e4m3" else RECIPES["rowwise"]
    groups = ExpertGroups(counts)
    x, weights, g = _tokens(groups, K), torch.randn(groups.num_experts, N, K), _tokens(groups, N)
    inputs, weight, grad = (_quantizer(recipe, role) for role in TensorRole)
    a = _per_expert(groups, lambda e: inputs.cast(x[groups.group(e)]))
    b = _per_expert(groups, lambda e: weight.cast(weights[e]).t())
    assert grouped_kernel_takes(a, b)
    args = grouped_kernel_arguments(a, b, groups, contraction=False)
    dense = grouped_fp8_gemm(a, b, groups, N, torch.bfloat16, Gemm.FPROP)
    assert_bitwise_equal(_emulated_grouped_kernel(*args, contraction=False), dense)

    g_t = _per_expert(groups, lambda e: grad.cast(g[groups.group(e)], 0).t())
    x_cm = _per_expert(groups, lambda e: inputs.cast(x[groups.group(e)], 0))
    g_t = [None if p is None else p.with_data(p.data.contiguous()) for p in g_t]
    x_cm = [None if p is None else p.with_data(p.data.t().contiguous().t()) for p in x_cm]
    args = grouped_kernel_arguments(g_t, x_cm, groups, contraction=True)
    dense = grouped_fp8_wgrad(g_t, x_cm, groups, (N, K), torch.bfloat16)
    assert_bitwise_equal(_emulated_grouped_kernel(*args, contraction=True), dense)


def test_grouped_kernel_takes_e4m3_with_tensorwise_or_rowwise_scales_only() -> None:
    x = torch.randn(16, K)
    for recipe, role, takes in [
        (Recipe(fp8_format="E4M3"), TensorRole.INPUT, True),
        (RECIPES["rowwise"], TensorRole.INPUT, True),
        (Recipe(), TensorRole.GRAD_OUTPUT, False),  # E5M2
        (RECIPES["block"], TensorRole.INPUT, False),
        (RECIPES["mxfp8"], TensorRole.INPUT, False),
    ]:
        assert grouped_kernel_takes([_quantizer(recipe, role).cast(x)], [None]) is takes, (recipe, role)


def _kernel_case(case: str):
    groups = ExpertGroups((16, 32))
    quantizer = _quantizer(Recipe(fp8_format="E4M3"), TensorRole.INPUT)
    a = _per_expert(groups, lambda e: quantizer.cast(torch.randn(groups.sizes[e], K)))
    b = _per_expert(groups, lambda e: quantizer.cast(torch.randn(N, K)).t())
    mat_a, mat_b, scale_a, scale_b, offs = grouped_kernel_arguments(a, b, groups, contraction=False)
    cases = {
        "group not aligned": ((mat_a, mat_b, scale_a, scale_b, offs - 1), "multiples of 16"),
        "b row-major": ((mat_a, mat_b.contiguous(), scale_a, scale_b, offs), "column major"),
        "E5M2 operand": ((mat_a.float().to(E5M2), mat_b, scale_a, scale_b, offs), "E4M3"),
        "scales too short": ((mat_a, mat_b, scale_a[:-1], scale_b, offs), "elements"),
        "int64 offsets": ((mat_a, mat_b, scale_a, scale_b, offs.long()), "int32"),
    }
    return cases[case]


@pytest.mark.parametrize(
    "case", ["group not aligned", "b row-major", "E5M2 operand", "scales too short", "int64 offsets"]
)
def test_grouped_kernel_contract_is_checked_on_the_cpu(case: str) -> None:
    args, message = _kernel_case(case)
    with pytest.raises(ValueError, match=message):
        check_grouped_operands(*args)


def test_group_alignment_is_the_gemm_alignment() -> None:
    assert ExpertGroups((1,)).sizes == (GEMM_ALIGNMENT,)


@cuda_fp8
@pytest.mark.skipif(
    not (torch.cuda.is_available() and _compat.native_grouped_scaled_mm(torch.device("cuda"))),
    reason="needs torch's grouped FP8 kernel (sm_90 or sm_100)",
)
def test_grouped_kernel_on_cuda_matches_the_per_expert_gemms() -> None:
    recipe = RECIPES["rowwise"]
    groups = ExpertGroups((40, 0, 200, 16))
    x, weights = _tokens(groups, 128).cuda(), torch.randn(groups.num_experts, 256, 128, device="cuda")
    a = _per_expert(groups, lambda e: _quantizer(recipe, TensorRole.INPUT).cast(x[groups.group(e)]))
    b = _per_expert(groups, lambda e: _quantizer(recipe, TensorRole.WEIGHT).cast(weights[e]).t())
    grouped = grouped_fp8_gemm(a, b, groups, 256, torch.bfloat16, Gemm.FPROP)
    dense = torch.cat([
        fp8_gemm(a[e], b[e], torch.bfloat16, Gemm.FPROP) if e in groups.active else torch.zeros(0, 256, device="cuda")
        for e in range(groups.num_experts)
    ])
    assert_sqnr_at_least(dense.float(), grouped.float(), 40.0)
