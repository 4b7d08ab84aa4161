"""The operands of a weight-gradient GEMM (wgrad) ``g2^T @ x2``, which contracts the
token dim M: both FP8, padded with zero rows to a multiple of ``GEMM_ALIGNMENT``, with
scales along M (except under one scale per tensor), and the outlier tokens taken out
where the recipe splits them (``amp8.nn.outlier_split``). ``Fp8Linear``'s Function and
``Fp8Experts``' (per expert) take their wgrad operands from here.
"""

from __future__ import annotations

import torch

from amp8.nn.gemm_config import LinearGemmConfig
from amp8.nn.outlier_split import split_outlier_tokens
from amp8.nn.quantizer import LinearQuantizers, Quantizer
from amp8.quant.health import GemmOperand
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, is_column_major, pad_rows
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor


def wgrad_operands(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    g8: ScaledTensor | None,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> tuple[ScaledTensor, ScaledTensor, torch.Tensor | None]:
    """The FP8 operands of the weight-gradient GEMM ``g2^T @ x2`` and the float32
    contribution of the outlier tokens it takes out (None where it splits none).

    Args:
        wgrad_input: the forward's FP8 input (M, K) where it was kept, else the
            high-precision input.
        g2: the (M, N) output gradient.
        g8: its tensorwise FP8 cast (tensorwise recipes), else None; row-major, or
            padded and column-major as ``padded_columns`` gives it.
        quantizers: the casts of each role.
        config: the GEMMs' config (``config.high_wgrad`` False).

    Returns:
        ``(g_t, x_columns, outliers)``: the (N, M') output gradient, row-major, and the
        (M', K) input, column-major, with M' = M padded with zero rows to a multiple of
        ``GEMM_ALIGNMENT``; scales along M except under one scale per tensor.
    """
    outliers = None
    if config.tensorwise:
        g_columns = padded_columns(g8)  # type: ignore[arg-type]
        x_columns = padded_columns(wgrad_input)  # type: ignore[arg-type]
    else:  # scales along the token dim M, which wgrad contracts
        x2 = real_values(wgrad_input)  # the forward's FP8 input is re-cast from its values
        if config.wgrad_outlier_share:
            outliers, x2, g2 = split_outlier_tokens(x2, g2, config.wgrad_outlier_share)
        g_columns = _padded_columns_cast(quantizers.grad_output, g2, config.watched(GemmOperand.WGRAD_GRAD_OUTPUT))
        x_columns = _padded_columns_cast(quantizers.input, x2, config.watched(GemmOperand.WGRAD_INPUT))
    return g_columns.t(), x_columns, outliers


def padded_columns(x8: ScaledTensor) -> ScaledTensor:
    """The (M, K) FP8 operand ``x8`` with zero rows appended to a multiple of
    ``GEMM_ALIGNMENT``, column-major: as a cast with ``columns`` writes it for an aligned
    M (then returned as it is), else copied so."""
    data = x8.data
    if data.shape[0] % GEMM_ALIGNMENT == 0 and is_column_major(data):
        return x8
    return x8.with_data(column_major(pad_rows(data, GEMM_ALIGNMENT)))


def _padded_columns_cast(quantizer: Quantizer, x2: torch.Tensor, watch: tuple[GemmOperand, ...]) -> ScaledTensor | BlockScaledTensor:
    """``x2`` padded with zero rows to a multiple of ``GEMM_ALIGNMENT``, cast with scales
    along its rows (the tokens wgrad contracts), column-major."""
    return quantizer.cast_layouts(x2, 0, watch=watch, rows=False, columns=True, padded=True).columns  # type: ignore[return-value]


def real_values(x: torch.Tensor | ScaledTensor) -> torch.Tensor:
    """The values of ``x`` in float32, dequantized where it is FP8 with its scales."""
    return x.dequantize() if isinstance(x, ScaledTensor) else x.float()
