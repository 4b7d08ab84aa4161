"""The operands of a weight-gradient GEMM (wgrad) ``g2^T @ x2``, which contracts the
token dim M: both FP8, padded with zero rows to a multiple of ``GEMM_ALIGNMENT``, with
scales along M (except under one scale per tensor), and the outlier tokens taken out
where the recipe splits them (``amp8.nn.outlier_split``). ``Fp8Linear``'s Function and
``Fp8Experts``' (per expert) take their wgrad operands from here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amp8.nn.gemm_config import LinearGemmConfig
from amp8.nn.outlier_split import split_outlier_tokens
from amp8.nn.quantizer import CastRequest, LinearQuantizers, OperandCast, Quantizer, cast_operands
from amp8.quant.health import GemmOperand
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, is_column_major, pad_rows
from amp8.tensor.scaled import ScaledTensor


class WgradCasts(NamedTuple):
    """The casts a weight-gradient GEMM needs besides the forward's (``wgrad_casts``):
    the output gradient's and the input's, each padded and column-major with scales along
    M (none under one scale per tensor), and the float32 contribution of the outlier
    tokens taken out (None where none are)."""

    requests: tuple[CastRequest, ...]
    outliers: torch.Tensor | None


def wgrad_casts(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> WgradCasts:
    """The casts of the weight-gradient GEMM ``g2^T @ x2`` (``config.high_wgrad`` False),
    to run with the backward's other casts (``amp8.nn.quantizer.cast_operands``); what
    they give goes to ``wgrad_operands``.

    Args:
        wgrad_input: the forward's FP8 input (M, K) where it was kept (one scale per
            tensor, or ``config.fp8_saved_input``), else the high-precision input.
        g2: the (M, N) output gradient.
        quantizers: the casts of each role.
        config: the GEMMs' config.
    """
    if config.tensorwise:  # the forward's and the output gradient's first casts serve wgrad
        return WgradCasts((), None)
    x2 = real_values(wgrad_input)  # the forward's FP8 input is re-cast from its values
    outliers = None
    if config.wgrad_outlier_share:
        outliers, x2, g2 = split_outlier_tokens(x2, g2, config.wgrad_outlier_share)
    return WgradCasts((
        _padded_columns_request(quantizers.grad_output, g2, config.watched(GemmOperand.WGRAD_GRAD_OUTPUT)),
        _padded_columns_request(quantizers.input, x2, config.watched(GemmOperand.WGRAD_INPUT)),
    ), outliers)


def wgrad_operands(
    wgrad_input: torch.Tensor | ScaledTensor, g8: ScaledTensor | None, casts: tuple[OperandCast, ...]
) -> tuple[ScaledTensor, ScaledTensor]:
    """The FP8 operands of the weight-gradient GEMM ``g2^T @ x2``: ``(g_t, x_columns)``,
    the (N, M') output gradient, row-major, and the (M', K) input, column-major, with M'
    = M padded with zero rows to a multiple of ``GEMM_ALIGNMENT``; scales along M except
    under one scale per tensor.

    Args:
        wgrad_input: as ``wgrad_casts`` takes it.
        g8: the output gradient's tensorwise FP8 cast (tensorwise recipes), else None;
            row-major, or padded and column-major as ``padded_columns`` gives it.
        casts: what ``wgrad_casts``' requests gave, in order (none under one scale per
            tensor).
    """
    if not casts:
        g_columns, x_columns = padded_columns(g8), padded_columns(wgrad_input)  # type: ignore[arg-type]
    else:
        g_columns, x_columns = casts[0].columns, casts[1].columns
    return g_columns.t(), x_columns  # type: ignore[union-attr]


def cast_wgrad_operands(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    g8: ScaledTensor | None,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> tuple[ScaledTensor, ScaledTensor, torch.Tensor | None]:
    """``wgrad_operands`` after ``wgrad_casts`` alone (one call of compiled casts):
    ``(g_t, x_columns, outliers)``."""
    casts = wgrad_casts(wgrad_input, g2, quantizers, config)
    g_t, x_columns = wgrad_operands(wgrad_input, g8, cast_operands(casts.requests))
    return g_t, x_columns, casts.outliers


def padded_columns(x8: ScaledTensor) -> ScaledTensor:
    """The (M, K) FP8 operand ``x8`` with zero rows appended to a multiple of
    ``GEMM_ALIGNMENT``, column-major: as a cast with ``columns`` writes it for an aligned
    M (then returned as it is), else copied so."""
    data = x8.data
    if data.shape[0] % GEMM_ALIGNMENT == 0 and is_column_major(data):
        return x8
    return x8.with_data(column_major(pad_rows(data, GEMM_ALIGNMENT)))


def _padded_columns_request(quantizer: Quantizer, x2: torch.Tensor, watch: tuple[GemmOperand, ...]) -> CastRequest:
    """The cast of ``x2`` padded with zero rows to a multiple of ``GEMM_ALIGNMENT``, with
    scales along its rows (the tokens wgrad contracts), column-major."""
    return quantizer.request(x2, contract_dim=0, watch=watch, rows=False, columns=True, padded=True)


def real_values(x: torch.Tensor | ScaledTensor) -> torch.Tensor:
    """The values of ``x`` in float32, dequantized where it is FP8 with its scales."""
    return x.dequantize() if isinstance(x, ScaledTensor) else x.float()
