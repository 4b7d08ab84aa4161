from dataclasses import replace

import pytest
import torch

from amp8.config.formats import E4M3, E5M2
from amp8.config.gemms import Gemm
from amp8.ops.gemm import check_fp8_device, check_operands, fp8_gemm, fp8_mm, rounded_dtype
from amp8.quant import scaling
from amp8.tensor.scaled import ScaledTensor
from conftest import assert_bitwise_equal, assert_sqnr_at_least, cuda_fp8

SHAPES = [(16, 32, 16), (37, 64, 48), (128, 256, 96)]


def _operands(m: int, k: int, n: int, a_dtype=E4M3, b_dtype=E4M3, power_of_2=False):
    a, b = torch.randn(m, k), torch.randn(n, k)
    sa = scaling.scale_from_amax(scaling.amax(a), a_dtype, power_of_2=power_of_2)
    sb = scaling.scale_from_amax(scaling.amax(b), b_dtype, power_of_2=power_of_2)
    return a, b, scaling.quantize(a, sa, a_dtype), scaling.quantize(b, sb, b_dtype), sa, sb


# E4M3 x E4M3 holds the 25 dB floor of DESIGN.md. An E5M2 operand (a gradient under
# HYBRID) has 2 mantissa bits: its own cast measures about 25.5 dB, so a GEMM with one
# lands near 24 dB; its floor is 22 dB.
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize(
    ("a_dtype", "b_dtype", "floor_db"), [(E4M3, E4M3, 25.0), (E5M2, E4M3, 22.0), (E4M3, E5M2, 22.0)]
)
def test_fp8_gemm_sqnr_against_fp32(m, k, n, a_dtype, b_dtype, floor_db) -> None:
    a, b, a8, b8, sa, sb = _operands(m, k, n, a_dtype, b_dtype)
    out = fp8_mm(a8, b8.t(), sa, sb, torch.float32, Gemm.WGRAD)
    assert out.shape == (m, n)
    assert_sqnr_at_least(a @ b.t(), out, floor_db)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("role", list(Gemm))
def test_equals_dequantize_then_matmul_with_power_of_2_scales(m, k, n, role) -> None:
    _, _, a8, b8, sa, sb = _operands(m, k, n, power_of_2=True)
    out = fp8_mm(a8, b8.t(), sa, sb, torch.float32, role)
    emulated = scaling.dequantize(a8, sa) @ scaling.dequantize(b8, sb).t()
    assert_bitwise_equal(out, emulated)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_dtype(out_dtype: torch.dtype) -> None:
    _, _, a8, b8, sa, sb = _operands(16, 32, 16)
    assert fp8_mm(a8, b8.t(), sa, sb, out_dtype, Gemm.FPROP).dtype == out_dtype


def _contract_case(case: str):
    _, _, a8, b8, sa, sb = _operands(32, 64, 48)
    b_col = b8.t()
    cases = {
        "a column-major": (a8.t().contiguous().t(), b_col, sa, sb, "row-major"),
        "b row-major": (a8, b_col.contiguous(), sa, sb, "column-major"),
        "K not multiple of 16": (a8[:, :40].contiguous(), b8[:, :40].t(), sa, sb, "multiples of 16"),
        "N not multiple of 16": (a8, b8[:40].t(), sa, sb, "multiples of 16"),
        "two E5M2": (a8.float().to(E5M2), b8.float().to(E5M2).t(), sa, sb, "two E5M2"),
        "high precision operand": (a8.float(), b_col, sa, sb, "FP8 dtype"),
        "scale not scalar": (a8, b_col, sa.expand(32, 1).contiguous(), sb, "float32 scalar"),
        "scale float64": (a8, b_col, sa.double(), sb, "float32 scalar"),
        "shapes do not chain": (a8, b8[:, :48].t(), sa, sb, "do not chain"),
    }
    return cases[case]


CONTRACT_CASES = [
    "a column-major", "b row-major", "K not multiple of 16", "N not multiple of 16", "two E5M2",
    "high precision operand", "scale not scalar", "scale float64", "shapes do not chain",
]


@pytest.mark.parametrize("case", CONTRACT_CASES)
def test_cuda_contract_is_enforced_on_the_cpu(case: str) -> None:
    a, b, sa, sb, message = _contract_case(case)
    with pytest.raises(ValueError, match=message):
        fp8_mm(a, b, sa, sb, torch.float32, Gemm.FPROP)


@pytest.mark.parametrize(("out_dtype", "bias_dtype"), [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
])
def test_a_bias_cuda_cannot_add_in_the_gemm_is_refused(out_dtype: torch.dtype, bias_dtype: torch.dtype) -> None:
    """CUDA's ``torch._scaled_mm`` adds a bias only to a bfloat16 or float16 output, in its
    dtype; the CPU's takes more, so the contract is checked here."""
    _, _, a8, b8, sa, sb = _operands(16, 32, 16)
    with pytest.raises(ValueError, match="bias"):
        check_operands(a8, b8.t(), sa, sb, out_dtype, torch.zeros(16, dtype=bias_dtype))


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tensorwise_gemm_adds_the_bias_to_its_float32_product(m: int, k: int, n: int,
                                                                 out_dtype: torch.dtype) -> None:
    """The bias joins the float32 product before the one rounding to ``out_dtype``: in the
    GEMM for a 16-bit output, after it for a float32 one (where the sum rounds once too)."""
    _, _, a8, b8, sa, sb = _operands(m, k, n, power_of_2=True)
    bias = torch.randn(n).to(out_dtype)
    product = fp8_mm(a8, b8.t(), sa, sb, torch.float32, Gemm.FPROP)
    out = fp8_mm(a8, b8.t(), sa, sb, out_dtype, Gemm.FPROP, bias=bias)
    assert out.dtype == out_dtype
    assert_bitwise_equal(out, (product + bias.float()).to(out_dtype))


def test_bad_out_dtype() -> None:
    _, _, a8, b8, sa, sb = _operands(16, 32, 16)
    with pytest.raises(ValueError, match="out_dtype"):
        check_operands(a8, b8.t(), sa, sb, torch.int32)


def test_cpu_is_an_fp8_device() -> None:
    check_fp8_device(torch.device("cpu"))


def test_device_without_fp8_is_rejected() -> None:
    with pytest.raises(RuntimeError, match="cannot run FP8 GEMMs"):
        check_fp8_device(torch.device("meta"))


def test_old_cuda_gpu_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"A100 \(sm_80\) has no FP8 tensor cores"):
        check_fp8_device(torch.device("cuda", 0))


@cuda_fp8
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_cuda_gemm_matches_cpu(m, k, n) -> None:
    _, _, a8, b8, sa, sb = _operands(m, k, n, power_of_2=True)
    cpu = fp8_mm(a8, b8.t(), sa, sb, torch.float32, Gemm.WGRAD)
    gpu = fp8_mm(a8.cuda(), b8.cuda().t(), sa.cuda(), sb.cuda(), torch.float32, Gemm.WGRAD)
    # Hopper's FP8 tensor cores add the products of a K-chunk at about 14 bits, aligned to
    # the largest (measured on an H100: 3e-4 of the largest output at K=32), so the bound
    # is relative to the output's range, not to each element.
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2**-10 * cpu.abs().max().item(), rtol=0)


def _rowwise_operands(m: int, k: int, n: int) -> tuple[ScaledTensor, ScaledTensor]:
    """Rowwise FP8 operands ``a`` (M, K) and ``b`` (K, N), as casts give them (scales
    and their reciprocals; ``b`` the transpose of an (N, K) cast)."""
    torch.manual_seed(0)
    a, w = torch.randn(m, k), torch.randn(n, k)
    a_scale = scaling.scale_from_amax(a.abs().amax(1, keepdim=True), E4M3)
    w_scale = scaling.scale_from_amax(w.abs().amax(1, keepdim=True), E4M3)
    a8 = ScaledTensor(scaling.quantize(a, a_scale, E4M3), a_scale, 0, a_scale.reciprocal())
    w8 = ScaledTensor(scaling.quantize(w, w_scale, E4M3), w_scale, 0, w_scale.reciprocal())
    return a8, w8.t()


@pytest.mark.parametrize(("m", "k", "n"), [(16, 32, 48), (1, 16, 16), (40, 64, 32)])
def test_a_rowwise_gemm_rounds_to_bf16_and_takes_the_casts_reciprocals(m: int, k: int, n: int) -> None:
    a8, b8 = _rowwise_operands(m, k, n)
    assert rounded_dtype(a8, b8, torch.float32) is torch.bfloat16
    assert rounded_dtype(a8, b8, torch.float16) is torch.float16
    full = fp8_gemm(a8, b8, torch.float32, Gemm.WGRAD)
    rounded = fp8_gemm(a8, b8, rounded_dtype(a8, b8, torch.float32), Gemm.WGRAD)
    assert full.dtype is torch.float32 and rounded.dtype is torch.bfloat16
    assert_bitwise_equal(full, rounded.float())  # the same values, one conversion fewer
    # The reciprocals handed over (transposed views included) give what computing them gives.
    bare = fp8_gemm(replace(a8, inverse=None), replace(b8, inverse=None), torch.bfloat16, Gemm.FPROP)
    assert_bitwise_equal(fp8_gemm(a8, b8, torch.bfloat16, Gemm.FPROP), bare)


def test_a_tensorwise_gemm_rounds_to_the_dtype_asked_for() -> None:
    a = ScaledTensor(torch.randn(16, 32).to(E4M3), torch.tensor(1.0))
    b = ScaledTensor(torch.randn(16, 32).to(E4M3), torch.tensor(1.0)).t()
    assert rounded_dtype(a, b, torch.float32) is torch.float32
