"""The one place that calls ``torch._scaled_mm``, and the FP8 device check.

``torch._scaled_mm`` on the CPU accepts layouts and shapes that CUDA rejects. ``fp8_mm``
checks the CUDA operand contract on every device, so a layout bug fails in CPU tests too.

``fp8_gemm`` multiplies two ``ScaledTensor`` operands at any granularity:

- tensorwise scales: one ``torch._scaled_mm`` call with scalar scales;
- rowwise scales ((M, 1) and (1, N)): one ``torch._scaled_mm`` call with rowwise scales,
  whose output is bfloat16 or float16 (CUDA's rowwise kernels write no float32 except
  through cuBLAS >= 12.9 on sm_90, so amp8 never asks for it; the CPU would accept it).
  On a CPU whose torch lacks rowwise scales (``amp8._compat``) ``emulated_scaled_mm``
  computes the same bits;
- block scales: ``fp8_mm_blockwise``, a sum over K-blocks of unit-scale ``_scaled_mm``
  products, each multiplied by its block scales and accumulated in float32;
- microscaled operands (``BlockScaledTensor``: MXFP8, NVFP4): ``amp8.ops.block_scaled``.
"""

from __future__ import annotations

import torch

from amp8 import _compat
from amp8.config.formats import E5M2, FP8_DTYPES
from amp8.config.gemms import Gemm
from amp8.config.validation import removed_name
from amp8.ops.block_scaled import microscaled_gemm
from amp8.quant import scaling
from amp8.quant.scale_layout import GEMM_ALIGNMENT, is_column_major, is_row_major
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROWWISE_OUT_DTYPES = (torch.bfloat16, torch.float16)
_EPILOGUE_OUT_DTYPES = _ROWWISE_OUT_DTYPES  # the outputs CUDA adds a bias to in the GEMM
_MIN_CUDA_CAPABILITY = (8, 9)


def check_operands(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` if ``a @ b`` (``+ bias``) breaks the CUDA contract of
    ``torch._scaled_mm``.

    The contract: ``a`` (M, K) row-major, ``b`` (K, N) column-major, both FP8 and at most
    one of them E5M2; K and N multiples of 16; scales float32, either both scalars
    (tensorwise) or (M, 1) and (1, N) (rowwise), and rowwise scales only with a bfloat16
    or float16 output; a bias (N,) only with a bfloat16 or float16 output, in that dtype.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"FP8 GEMM takes 2-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"FP8 GEMM operands do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    for name, operand in (("a", a), ("b", b)):
        if operand.dtype not in FP8_DTYPES:
            raise ValueError(f"FP8 GEMM operand {name} is {operand.dtype}; cast it to an FP8 dtype first")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("FP8 GEMM got two E5M2 operands; at most one may be E5M2 (use E4M3 for the other)")
    k, n = b.shape
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(
            f"FP8 GEMM needs K and N to be multiples of {GEMM_ALIGNMENT}, got K={k}, N={n}; "
            "pad the operands or keep this layer in high precision"
        )
    if not is_row_major(a):
        raise ValueError(f"FP8 GEMM operand a must be row-major (M, K), got strides {a.stride()}")
    if not is_column_major(b):
        raise ValueError(
            f"FP8 GEMM operand b must be column-major (K, N), got strides {b.stride()}; "
            "pass the transpose of a contiguous (N, K) tensor"
        )
    m, n = a.shape[0], b.shape[1]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32 or not (tensorwise or rowwise):
        raise ValueError(
            f"FP8 GEMM scales must be float32 scalars (tensorwise) or of shapes ({m}, 1) and "
            f"(1, {n}) (rowwise); got scale_a {scale_a.dtype} {tuple(scale_a.shape)} and "
            f"scale_b {scale_b.dtype} {tuple(scale_b.shape)}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"FP8 GEMM out_dtype {out_dtype} is not one of {_OUT_DTYPES}")
    if rowwise and not tensorwise and out_dtype not in _ROWWISE_OUT_DTYPES:
        raise ValueError(
            f"FP8 GEMM with rowwise scales cannot write {out_dtype} on every CUDA GPU; ask for "
            "bfloat16 or float16 and convert the result"
        )
    if bias is not None and (out_dtype not in _EPILOGUE_OUT_DTYPES or bias.dtype != out_dtype or bias.shape != (n,)):
        raise ValueError(
            f"FP8 GEMM bias of {bias.dtype} {tuple(bias.shape)} with a {out_dtype} output: CUDA adds a bias "
            f"({n},) in the output's dtype to a bfloat16 or float16 output only; add it to the product instead"
        )


def fp8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    role: Gemm,
    inverse_a: torch.Tensor | None = None,
    inverse_b: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * scale_a_inverse) @ (b * scale_b_inverse)`` computed by ``torch._scaled_mm``.

    Args:
        a: FP8 (M, K), row-major.
        b: FP8 (K, N), column-major.
        scale_a, scale_b: the *storage* scales (``data = x * scale``); their inverses go
            to the GEMM.
        out_dtype: float32, bfloat16 or float16.
        role: which GEMM this is; fast accumulation is used for FPROP only.
        inverse_a, inverse_b: ``1 / scale_a`` and ``1 / scale_b`` where a cast computed
            them already (``ScaledTensor.inverse``; tensorwise scales); else computed here.
        bias: (N,) in ``out_dtype``, added to the float32 product before it is rounded (in
            the GEMM's epilogue where CUDA allows it: a bfloat16 or float16 output).
    """
    if bias is not None and out_dtype not in _EPILOGUE_OUT_DTYPES:
        # A float32 product plus a float32 bias is the same one rounding outside the GEMM.
        return fp8_mm(a, b, scale_a, scale_b, out_dtype, role, inverse_a, inverse_b) + bias
    check_operands(a, b, scale_a, scale_b, out_dtype, bias)
    if a.numel() == 0 or b.numel() == 0:  # an empty batch: no kernel takes every empty shape
        out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        return out if bias is None else out + bias
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1  # M = 1 gives a (1, 1) rowwise scale_a
    inverse_a = scale_a.reciprocal() if inverse_a is None else inverse_a
    inverse_b = scale_b.reciprocal() if inverse_b is None else inverse_b
    if rowwise and not _compat.native_rowwise_scaled_mm(a.device):
        out = emulated_scaled_mm(a, b, inverse_a, inverse_b, out_dtype)
        return out if bias is None else out + bias
    return torch._scaled_mm(
        a,
        b,
        scale_a=inverse_a,
        scale_b=inverse_b,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=role is Gemm.FPROP,
    )


@torch.library.custom_op("amp8::emulated_scaled_mm", mutates_args=())
def emulated_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)`` as
    the CPU computes it, for a torch whose CPU kernel lacks rowwise scales.

    Each operand is dequantized to float32 with its (decode) scales, ``b`` laid out
    row-major first as the kernel does, then one float32 matmul and one rounding to
    ``out_dtype``: bit for bit the CPU kernel's result on torch releases that have it,
    tensorwise or rowwise, with or without fast accumulation (which the CPU ignores).
    It is an operator of its own (``torch.ops.amp8.emulated_scaled_mm``), opaque to
    ``torch.compile`` as ``torch._scaled_mm`` is: Inductor would otherwise choose the
    dequantized ``b``'s layout itself, and a column-major one sums the matmul in another
    order.
    """
    return ((a.float() * scale_a) @ (b.contiguous().float() * scale_b)).to(out_dtype)


@emulated_scaled_mm.register_fake
def _emulated_scaled_mm_result(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The empty (M, N) result ``torch.compile`` traces ``emulated_scaled_mm`` with."""
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def fp8_mm_blockwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    block_size: int,
    out_dtype: torch.dtype,
    role: Gemm,
) -> torch.Tensor:
    """``a @ b`` for FP8 operands with one scale per K-block of ``block_size``.

    Each K-block is one ``torch._scaled_mm`` product with unit scales and a float32
    output (so ``fp8_mm`` checks the CUDA contract for it); the product is multiplied by
    the block's scales and added to a float32 sum. This is the DeepSeek-V3 scheme of
    promoting partial sums to FP32 every K-block, and runs the same on the CPU and CUDA.

    Args:
        a: FP8 (M, K), row-major.
        b: FP8 (K, N), column-major.
        scale_a: float32 (M, ceil(K / block_size)) storage scales of ``a``.
        scale_b: float32 (ceil(K / block_size), N) storage scales of ``b``.
        block_size: K elements per scale; the last K-block may be shorter.
        out_dtype: the dtype of the result.
        role: which GEMM this is (fast accumulation within a K-block for FPROP only).
    """
    m, k = a.shape
    n = b.shape[1]
    blocks = max(1, -(-k // block_size))  # an empty K (an empty batch, in wgrad) is one empty block
    if tuple(scale_a.shape) != (m, blocks) or tuple(scale_b.shape) != (blocks, n):
        raise ValueError(
            f"block-scaled FP8 GEMM of ({m}, {k}) @ ({k}, {n}) in K-blocks of {block_size} needs "
            f"scales of shapes ({m}, {blocks}) and ({blocks}, {n}); got {tuple(scale_a.shape)} "
            f"and {tuple(scale_b.shape)}"
        )
    unit = torch.ones((), device=a.device)
    inverse_a, inverse_b = scale_a.float().reciprocal(), scale_b.float().reciprocal()
    out = torch.zeros(m, n, device=a.device)
    for index, start in enumerate(range(0, k, block_size)):
        stop = min(start + block_size, k)
        partial = fp8_mm(a[:, start:stop], b[start:stop], unit, unit, torch.float32, role)
        out += partial * inverse_a[:, index : index + 1] * inverse_b[index : index + 1]
    return out.to(out_dtype)


def fp8_gemm(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype, role: Gemm,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (``+ bias``) for scaled FP8 operands at any granularity (see the module
    docstring).

    Args:
        a: (M, K), data row-major; scale (), (M, 1) or (M or ceil(M / block), ceil(K / block)).
        b: (K, N), data column-major; scale (), (1, N) or (ceil(K / block), N or ceil(N / block)).
            Operands with a ``block_size`` take the block path even when their scales
            look rowwise (one K-block), so that path never depends on the shapes.
        out_dtype: float32, bfloat16 or float16.
        role: which GEMM this is.
        bias: (N,) in ``out_dtype``, added to the float32 product before it is rounded
            to ``out_dtype`` (in the GEMM's epilogue under one scale per tensor; after
            it, rounded once more, otherwise).

    Raises:
        ValueError: operands that break the CUDA contract, or scales that do not pair up
            along K.
    """
    microscaled = isinstance(a, BlockScaledTensor) or isinstance(b, BlockScaledTensor)
    if bias is not None and (microscaled or a.scale.dim() > 0 or b.scale.dim() > 0):
        return fp8_gemm(a, b, out_dtype, role) + bias
    if microscaled:
        return microscaled_gemm(a, b, out_dtype, role)  # type: ignore[arg-type]
    (m, k), n = a.shape, b.shape[1]
    scale_a, scale_b = a.scale, b.scale
    if scale_a.dim() == 0 and scale_b.dim() == 0:
        return fp8_mm(a.data, b.data, scale_a, scale_b, out_dtype, role, a.inverse, b.inverse, bias)
    if _rowwise(a, b):
        inverse_a, inverse_b = (None if x.inverse is None else _vector_strides(x.inverse) for x in (a, b))
        return fp8_mm(a.data, b.data, scale_a, scale_b, rounded_dtype(a, b, out_dtype), role, inverse_a,
                      inverse_b).to(out_dtype)
    if scale_a.dim() != 2 or scale_b.dim() != 2 or scale_a.shape[1] != scale_b.shape[0]:
        raise ValueError(
            f"FP8 GEMM scales {tuple(scale_a.shape)} and {tuple(scale_b.shape)} do not pair up "
            "along K; quantize both operands with tiles along the contraction dimension"
        )
    block_size = max(a.block_size, b.block_size) if scale_a.shape[1] > 1 else max(k, 1)
    # Per-row (per-column) scales of every K-block: blocks along M and N repeat out.
    full_a = scaling.expand_scale(scale_a, (m, scale_a.shape[1]), a.block_size).expand(m, -1)
    full_b = scaling.expand_scale(scale_b, (scale_b.shape[0], n), b.block_size).expand(-1, n)
    return fp8_mm_blockwise(a.data, b.data, full_a, full_b, block_size, out_dtype, role)


def _rowwise(a: ScaledTensor, b: ScaledTensor) -> bool:
    """Whether ``a @ b`` takes one scale per row of ``a`` and per column of ``b``."""
    return (a.block_size == 0 and b.block_size == 0 and tuple(a.scale.shape) == (a.shape[0], 1)
            and tuple(b.scale.shape) == (1, b.shape[1]))


def rounded_dtype(a: ScaledTensor, b: ScaledTensor, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``fp8_gemm(a, b, out_dtype, ...)`` rounds its product to: ``out_dtype``,
    or bfloat16 for a float32 result under rowwise scales (which CUDA's kernels cannot
    write; ``fp8_gemm`` then converts the rounded values to float32). A caller that
    converts the result again (a weight gradient cast to FP8, say) can ask for this
    dtype and save that conversion: the values are the same."""
    if _rowwise(a, b) and out_dtype not in _ROWWISE_OUT_DTYPES:
        return torch.bfloat16
    return out_dtype


def _vector_strides(scales: torch.Tensor) -> torch.Tensor:
    """The (M, 1) or (1, N) rowwise ``scales`` with the strides ``torch._scaled_mm``
    takes, ``(1, 1)`` or ``(N, 1)``: a transposed view of a cast's scales has others,
    which it refuses."""
    return scales.reshape(-1).view(scales.shape)


def check_fp8_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` if ``device`` cannot run FP8 GEMMs.

    The CPU always can; CUDA needs compute capability 8.9 or newer (Ada, Hopper, Blackwell).
    """
    if device.type == "cpu":
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= _MIN_CUDA_CAPABILITY:
            return
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"{name} (sm_{capability[0]}{capability[1]}) has no FP8 tensor cores; FP8 needs "
            "sm_89 or newer (Ada, Hopper, Blackwell). Use opt_level='O0' on this GPU."
        )
    raise RuntimeError(
        f"device {device} cannot run FP8 GEMMs in amp8; use the CPU or a CUDA GPU with sm_89+, "
        "or opt_level='O0'"
    )


_REMOVED = {
    "GemmRole": "use amp8.config.Gemm (FPROP, DGRAD, WGRAD), an IntEnum: its values are 0, 1, 2 where "
    "GemmRole's were 'fprop', 'dgrad', 'wgrad'",
}


def __getattr__(name: str) -> object:
    """Removed names fail naming what replaces them."""
    raise removed_name("amp8.ops.gemm", name, _REMOVED, module=True)
