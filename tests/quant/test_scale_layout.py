"""The swizzled 128x4 scale layout and the Blackwell block-scaled GEMM contract, on the CPU."""

import pytest
import torch

from amp8.config.formats import E4M3, E5M2, E8M0, FP4
from amp8.ops.block_scaled import block_scaled_mm, check_block_scaled_operands
from amp8.quant import scale_layout
from amp8.quant.scaling import sqnr
from amp8.tensor import block_scaled as microscaling
from conftest import assert_bitwise_equal, assert_sqnr_at_least

SCALE_SHAPES = [(128, 4), (200, 7), (300, 33), (1, 1), (37, 2)]


def _reference_position(rows: int, columns: int) -> torch.Tensor:
    """Where cuBLAS's layout puts scale (r, c), as a flat index, written out from the
    documented formula: tiles of 128 x 4 in row-major tile order, 512 bytes each; inside
    a tile row r goes to (r % 32, 4 * ((r % 128) // 32)) and column c adds c % 4."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(columns)[None, :]
    column_tiles = -(-columns // 4)
    tile = (r // 128) * column_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize(("rows", "columns"), SCALE_SHAPES)
def test_swizzle_puts_each_scale_where_cublas_reads_it(rows, columns) -> None:
    scales = torch.randint(1, 255, (rows, columns), dtype=torch.uint8).view(E8M0)
    swizzled = scale_layout.swizzle(scales)
    assert swizzled.shape == scale_layout.swizzled_shape(rows, columns) and swizzled.is_contiguous()
    flat = swizzled.view(torch.uint8).flatten()
    assert_bitwise_equal(flat[_reference_position(rows, columns)], scales.view(torch.uint8))
    placed = torch.zeros_like(flat, dtype=torch.bool)
    placed[_reference_position(rows, columns).flatten()] = True
    assert int(flat[~placed].count_nonzero()) == 0, "padding holds zero bytes"
    assert_bitwise_equal(scale_layout.unswizzle(swizzled, rows, columns), scales)


def _mx_operands(m=200, k=96, n=48, fmt="mxfp8"):
    a, b = torch.randn(m, k), torch.randn(n, k)
    if fmt == "mxfp8":
        qa, qb = microscaling.quantize_mx(a, E4M3, (1, 32)), microscaling.quantize_mx(b, E4M3, (1, 32))
        data_a, data_b = qa.data, qb.data.t()
    else:
        qa, qb = microscaling.quantize_nvfp4(a, (1, 16)), microscaling.quantize_nvfp4(b, (1, 16))
        data_a, data_b = qa.data.view(FP4), qb.data.view(FP4).t()
    return a, b, qa, qb, data_a, data_b


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_mm_reads_swizzled_scales_and_equals_dequantize_then_matmul(fmt) -> None:
    a, b, qa, qb, data_a, data_b = _mx_operands(fmt=fmt)
    alpha = qa.tensor_scale * qb.tensor_scale
    out = block_scaled_mm(data_a, data_b, scale_layout.swizzle(qa.scales), scale_layout.swizzle(qb.scales), alpha)
    expected = (qa.dequantize() @ qb.dequantize().t()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert_sqnr_at_least(a @ b.t(), out, 24.0 if fmt == "mxfp8" else 14.0)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_unswizzled_scales_fail_the_contract_on_the_cpu(fmt) -> None:
    _, _, qa, qb, data_a, data_b = _mx_operands(fmt=fmt)
    # the plain (rows, K-blocks) scales, padded to whole 128x4 tiles: the bytes cuBLAS
    # wants, in the wrong layout
    plain = torch.nn.functional.pad(qa.scales.view(torch.uint8), (0, -qa.scales.shape[1] % 4, 0, -200 % 128))
    with pytest.raises(ValueError, match="swizzled 128x4 tile layout"):
        check_block_scaled_operands(data_a, data_b, plain.view(qa.scales.dtype), scale_layout.swizzle(qb.scales),
                                    torch.bfloat16)
    with pytest.raises(ValueError, match="swizzled 128x4 tile layout"):
        check_block_scaled_operands(data_a, data_b, qa.scales, scale_layout.swizzle(qb.scales), torch.bfloat16)


def test_scales_reshaped_without_swizzling_give_a_wrong_product() -> None:
    # the same bytes in the swizzled shape but unswizzled order pass the shape check; the
    # emulation reads them as the hardware would, so the product is wrong, not silently right
    a = torch.randn(256, 128) * torch.logspace(-4, 4, 256, base=2)[:, None]  # rows of different range
    b = torch.randn(48, 128)
    qa, qb = microscaling.quantize_mx(a, E4M3, (1, 32)), microscaling.quantize_mx(b, E4M3, (1, 32))
    plain = qa.scales.view(torch.uint8).contiguous().view(scale_layout.swizzled_shape(256, 4)).view(E8M0)
    swizzled_b = scale_layout.swizzle(qb.scales)
    wrong = block_scaled_mm(qa.data, qb.data.t(), plain, swizzled_b, qa.tensor_scale)
    right = block_scaled_mm(qa.data, qb.data.t(), scale_layout.swizzle(qa.scales), swizzled_b, qa.tensor_scale)
    assert sqnr(a @ b.t(), wrong) < 5.0 < 25.0 < sqnr(a @ b.t(), right)


def _contract_case(case: str):
    _, _, qa, qb, a8, b8 = _mx_operands()
    sa, sb = scale_layout.swizzle(qa.scales), scale_layout.swizzle(qb.scales)
    _, _, fa, fb, a4, b4 = _mx_operands(fmt="nvfp4")
    sa4, sb4 = scale_layout.swizzle(fa.scales), scale_layout.swizzle(fb.scales)
    cases = {
        "float32 scales": (a8, b8, sa.float(), sb, torch.bfloat16, "float8_e8m0fnu"),
        "E4M3 scales on FP8": (a8, b8, sa.view(E4M3), sb.view(E4M3), torch.bfloat16, "float8_e8m0fnu"),
        "E8M0 scales on FP4": (a4, b4, sa4.view(E8M0), sb4.view(E8M0), torch.bfloat16, "float8_e4m3fn"),
        "FP8 with FP4": (a8[:, :48], b4, sa, sb4, torch.bfloat16, "two FP8 operands"),
        "two E5M2": (a8.float().to(E5M2), b8.float().to(E5M2), sa, sb, torch.bfloat16, "two E5M2"),
        "K not multiple of 32": (a8[:, :80].contiguous(), b8[:80], sa, sb, torch.bfloat16, "multiple of 32"),
        "b row-major": (a8, b8.contiguous(), sa, sb, torch.bfloat16, "column-major"),
        "float32 output": (a8, b8, sa, sb, torch.float32, "bfloat16"),
        "non-contiguous scales": (a8, b8, sa.t().contiguous().t(), sb, torch.bfloat16, "contiguous"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["float32 scales", "E4M3 scales on FP8", "E8M0 scales on FP4", "FP8 with FP4",
                                  "two E5M2", "K not multiple of 32", "b row-major", "float32 output",
                                  "non-contiguous scales"])
def test_block_scaled_contract_is_checked_on_the_cpu(case) -> None:
    a, b, sa, sb, out_dtype, message = _contract_case(case)
    with pytest.raises(ValueError, match=message):
        check_block_scaled_operands(a, b, sa, sb, out_dtype)


@pytest.mark.parametrize("shape", [(48, 32), (37, 16), (1, 16), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, E4M3])
def test_column_major_copies_the_values_with_transposed_strides(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype)
    copy = scale_layout.column_major(x)
    assert copy.shape == x.shape and copy.dtype == dtype
    assert scale_layout.is_column_major(copy)
    if x.numel():
        assert copy.stride() == (1, shape[0])
    assert_bitwise_equal(copy.contiguous(), x)
