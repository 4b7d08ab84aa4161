"""The one place that calls ``torch._scaled_mm``, and the FP8 device check.

``torch._scaled_mm`` on the CPU accepts layouts and shapes that CUDA rejects. ``fp8_mm``
checks the CUDA operand contract on every device, so a layout bug fails in CPU tests too.
"""

from __future__ import annotations

from enum import Enum

import torch

from .formats import E5M2, FP8_DTYPES

_GEMM_ALIGNMENT = 16
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_CUDA_CAPABILITY = (8, 9)


class GemmRole(str, Enum):
    """Which of a linear layer's three GEMMs is running; only FPROP may accumulate fast."""

    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


def _is_row_major(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.stride(0) >= max(1, x.shape[1])


def _is_column_major(x: torch.Tensor) -> bool:
    return x.stride(0) == 1 and x.stride(1) >= max(1, x.shape[0])


def check_operands(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> None:
    """Raise ``ValueError`` if ``a @ b`` breaks the CUDA contract of ``torch._scaled_mm``.

    The contract: ``a`` (M, K) row-major, ``b`` (K, N) column-major, both FP8 and at most
    one of them E5M2; K and N multiples of 16; tensorwise scales float32 scalars.
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
    if k % _GEMM_ALIGNMENT or n % _GEMM_ALIGNMENT:
        raise ValueError(
            f"FP8 GEMM needs K and N to be multiples of {_GEMM_ALIGNMENT}, got K={k}, N={n}; "
            "pad the operands or keep this layer in high precision"
        )
    if not _is_row_major(a):
        raise ValueError(f"FP8 GEMM operand a must be row-major (M, K), got strides {a.stride()}")
    if not _is_column_major(b):
        raise ValueError(
            f"FP8 GEMM operand b must be column-major (K, N), got strides {b.stride()}; "
            "pass the transpose of a contiguous (N, K) tensor"
        )
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(
                f"FP8 GEMM {name} must be a float32 scalar, got {scale.dtype} of shape {tuple(scale.shape)}"
            )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"FP8 GEMM out_dtype {out_dtype} is not one of {_OUT_DTYPES}")


def fp8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    role: GemmRole,
) -> torch.Tensor:
    """``(a * scale_a_inverse) @ (b * scale_b_inverse)`` computed by ``torch._scaled_mm``.

    Args:
        a: FP8 (M, K), row-major.
        b: FP8 (K, N), column-major.
        scale_a, scale_b: the *storage* scales (``data = x * scale``); their inverses go
            to the GEMM.
        out_dtype: float32, bfloat16 or float16.
        role: which GEMM this is; fast accumulation is used for FPROP only.
    """
    check_operands(a, b, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(
        a,
        b,
        scale_a=scale_a.reciprocal(),
        scale_b=scale_b.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=role is GemmRole.FPROP,
    )


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
