"""Block-scaled GEMMs of microscaled operands (Blackwell's MXFP8 and NVFP4).

``microscaled_gemm`` multiplies two ``BlockScaledTensor`` operands: one block-scaled
``torch._scaled_mm`` on sm_100+ with the scales swizzled as cuBLAS reads them
(``amp8.quant.scale_layout``), an exact emulation elsewhere that reads the same swizzled
scales back. Both run behind ``check_block_scaled_operands``, the Blackwell operand and
scale-layout contract, checked on every device so that a layout bug fails on the CPU too.
"""

from __future__ import annotations

import torch

from amp8.config.formats import E5M2, E8M0, FP8_DTYPES, is_fp4
from amp8.config.gemms import Gemm
from amp8.quant import scale_layout
from amp8.quant.scale_layout import GEMM_ALIGNMENT, is_column_major, is_row_major
from amp8.tensor.block_scaled import BlockScaledTensor, decode_fp4, unpack_fp4

_BLOCK_SCALED_K_ALIGNMENT = 32  # MXFP8's block; 16 bytes of packed FP4
_MIN_BLOCK_SCALED_CAPABILITY = (10, 0)


def _block_format(x: torch.Tensor, scale: torch.Tensor) -> tuple[int, torch.dtype] | None:
    """(block, scale dtype) of a block-scaled operand: MXFP8 (FP8 elements, E8M0 scales
    per 32) or NVFP4 (packed FP4, E4M3 scales per 16); None for anything else."""
    if is_fp4(x.dtype):
        return 16, torch.float8_e4m3fn
    if x.dtype in FP8_DTYPES:
        return 32, E8M0
    return None


def check_block_scaled_operands(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """Raise ``ValueError`` if ``a @ b`` breaks the Blackwell contract of the block-scaled
    ``torch._scaled_mm``.

    The contract: ``a`` (M, K) row-major and ``b`` (K, N) column-major, both FP8 (at most
    one E5M2) with E8M0 scales per 32 K-elements (MXFP8), or both FP4 packed two per byte
    along K (storage (M, K/2) and (K/2, N)) with E4M3 scales per 16 (NVFP4); K a multiple
    of 32 and N of 16; each operand's scales, as a (rows, K / block) matrix (rows M for
    ``a``, N for ``b``), contiguous in the swizzled 128 x 4 tile layout
    (``amp8.quant.scale_layout.swizzle``, shape ``swizzled_shape(rows, K / block)``); a
    bfloat16 output.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"block-scaled GEMM operands do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    formats = _block_format(a, scale_a), _block_format(b, scale_b)
    if formats[0] is None or formats[0] != formats[1]:
        raise ValueError(
            f"block-scaled GEMM takes two FP8 operands (MXFP8) or two packed FP4 operands (NVFP4); "
            f"got {a.dtype} and {b.dtype}"
        )
    block, scale_dtype = formats[0]
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("FP8 GEMM got two E5M2 operands; at most one may be E5M2 (use E4M3 for the other)")
    packing = 2 if is_fp4(a.dtype) else 1
    m, k, n = a.shape[0], a.shape[1] * packing, b.shape[1]
    if k % _BLOCK_SCALED_K_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(
            f"block-scaled GEMM needs K a multiple of {_BLOCK_SCALED_K_ALIGNMENT} and N of {GEMM_ALIGNMENT}, "
            f"got K={k}, N={n}; pad K with zero blocks"
        )
    if not is_row_major(a) or not is_column_major(b):
        raise ValueError(
            f"block-scaled GEMM needs a row-major (M, K) and b column-major (K, N); got strides "
            f"{a.stride()} and {b.stride()}"
        )
    for name, scale, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        expected = scale_layout.swizzled_shape(rows, k // block)
        if scale.dtype != scale_dtype or tuple(scale.shape) != expected or not scale.is_contiguous():
            raise ValueError(
                f"block-scaled GEMM {name} must be contiguous {scale_dtype} scales in the swizzled "
                f"128x4 tile layout, shape {expected} for ({rows}, {k // block}) block scales; got "
                f"{scale.dtype} {tuple(scale.shape)}. Lay them out with amp8.quant.scale_layout.swizzle"
            )
    if out_dtype != torch.bfloat16:
        raise ValueError(f"block-scaled GEMM writes bfloat16 on every Blackwell GPU, not {out_dtype}; convert after")


def _uses_blackwell_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= _MIN_BLOCK_SCALED_CAPABILITY


def _element_values(x: torch.Tensor, packed_dim: int) -> torch.Tensor:
    return decode_fp4(unpack_fp4(x, packed_dim)) if is_fp4(x.dtype) else x.float()


def block_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, alpha: torch.Tensor,
) -> torch.Tensor:
    """``alpha * (a @ b)`` with block decode scales, in bfloat16.

    On sm_100+ one ``torch._scaled_mm`` (its block-scaled modes take the swizzled scales
    as they are, and no fast accumulation); elsewhere an exact emulation: the scales read
    back from the swizzled layout, every block dequantized, float32 products and sums,
    then the same bfloat16 rounding. ``alpha``, the product of the operands' tensor
    scales (NVFP4; 1 for MX), is a power of two, so multiplying the bfloat16 result by
    it is exact on either path.
    Arguments as ``check_block_scaled_operands`` describes.
    """
    check_block_scaled_operands(a, b, scale_a, scale_b, torch.bfloat16)
    packing = 2 if is_fp4(a.dtype) else 1
    m, k, n = a.shape[0], a.shape[1] * packing, b.shape[1]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    if _uses_blackwell_kernel(a.device):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16) * alpha
    block = 16 if packing == 2 else 32
    rows_a = scale_layout.unswizzle(scale_a, m, k // block).float().repeat_interleave(block, 1)
    rows_b = scale_layout.unswizzle(scale_b, n, k // block).float().repeat_interleave(block, 1)
    real_a = _element_values(a, 1) * rows_a  # (M, K)
    real_b = _element_values(b, 0) * rows_b.t()  # (K, N)
    return (real_a @ real_b).to(torch.bfloat16) * alpha


def _along_rows(scales: torch.Tensor, repeat: int, rows: int) -> torch.Tensor:
    """Tile scales of shape (row tiles, K-blocks) repeated to one row per matrix row."""
    return scales.view(torch.uint8).repeat_interleave(repeat, 0)[:rows].view(scales.dtype)


def _pad_k(
    data: torch.Tensor, scales: torch.Tensor, k_bytes: int, k_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, K) element bytes, contiguous and padded along K with zero elements, as
    ``dtype``, and the (rows, K-blocks) scales padded with unit scales (a zero block adds
    nothing to the product)."""
    raw = torch.nn.functional.pad(data.view(torch.uint8), (0, k_bytes - data.shape[1])).contiguous()
    unit = torch.ones(scales.shape[0], k_blocks - scales.shape[1], device=scales.device).to(scales.dtype)
    return raw.view(dtype), torch.cat([scales, unit], 1)


def microscaled_gemm(
    a: BlockScaledTensor, b: BlockScaledTensor, out_dtype: torch.dtype, role: Gemm
) -> torch.Tensor:
    """``a @ b`` for microscaled operands: ``a`` (M, K) with tiles along K, ``b`` (K, N)
    with tiles along K (square weight tiles serve either dim). K is padded to a multiple
    of 32 with zero blocks, FP4 repacked along K where it was packed along the other dim,
    each operand's scales repeated to one row per M (N) row and swizzled, and
    ``block_scaled_mm`` runs; its bfloat16 result is converted to ``out_dtype``. ``role``
    changes nothing: block-scaled kernels have no fast-accumulation mode.

    Raises:
        TypeError: one operand is microscaled and the other is not.
        ValueError: the operands' K-blocks differ, or they break the contract.
    """
    if not isinstance(a, BlockScaledTensor) or not isinstance(b, BlockScaledTensor):
        raise TypeError(
            f"a microscaled GEMM needs two BlockScaledTensor operands, got {type(a).__name__} and "
            f"{type(b).__name__}; cast both with the same microscaled recipe"
        )
    (m, k), n = a.shape, b.shape[1]
    block = a.tile[1]
    if b.tile[0] != block:
        raise ValueError(f"microscaled operands have K-blocks of {a.tile[1]} and {b.tile[0]}; cast both with one recipe")
    a, b = a.packed_along(1), b.packed_along(0)
    padded_k = -(-max(k, 1) // _BLOCK_SCALED_K_ALIGNMENT) * _BLOCK_SCALED_K_ALIGNMENT
    packing = 2 if is_fp4(a.dtype) else 1
    scale_a = _along_rows(a.scales, a.tile[0], m)
    scale_b = _along_rows(b.scales.t(), b.tile[1], n)
    data_a, scale_a = _pad_k(a.data, scale_a, padded_k // packing, padded_k // block, a.dtype)
    data_b, scale_b = _pad_k(b.data.t(), scale_b, padded_k // packing, padded_k // block, b.dtype)
    out = block_scaled_mm(
        data_a, data_b.t(), scale_layout.swizzle(scale_a), scale_layout.swizzle(scale_b),
        a.tensor_scale * b.tensor_scale,
    )
    return out.to(out_dtype)
