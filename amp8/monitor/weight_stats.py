"""What the FP8 cast of one layer's weight does to it, as the precision report shows it:
the granularity, the scales' range, the amax, the shares of values flushed to zero and
clipped, and under microscaling the format and block (``weight_cast_stats``)."""

from __future__ import annotations


import torch

from amp8.config.formats import E8M0, is_fp4, max_value, short_name
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import TensorRole
from amp8.monitor.report_row import WeightCastStats
from amp8.quant import scaling

SHORT_DTYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float64": "fp64",
}
"""Short names of dtypes in the report's cells and formats."""

_ROUNDING = 2.0**-20
"""Relative slack for float32 rounding when checking whether a scaled value exceeds the max."""


NO_CAST = WeightCastStats()
"""The stats of a parameter that no FP8 layer casts."""


def weight_cast_stats(layer: Fp8Linear, weight: torch.Tensor) -> WeightCastStats:
    """Granularity, scales, amax, underflow and saturation of the FP8 cast of ``weight``,
    the layer's real weight (its master weight where the optimizer keeps one), in the
    weight Parameter's shape, and how the layer's GEMMs run."""
    stored_fp8 = layer.weight_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if layer.weight_transposed and (layer.quantizers.weight.rule.microscaled or not stored_fp8):
        weight = weight.t()  # the GEMMs cast W, (N, K), from the Parameter's W^T
    if layer.quantizers.weight.rule.microscaled:
        return _microscaled_cast_stats(layer, weight)
    if stored_fp8:
        scale, weight_amax = layer.stored_weight.scale, scaling.amax(weight)
        block_size = layer.block_size
    else:  # the cast the forward GEMM gets, at the GEMMs' granularity
        scale, weight_amax = layer.next_scale(TensorRole.WEIGHT, weight)
        block_size = layer.quantizers.weight.rule.scale_block_size
    dtype = layer.fp8_dtype(TensorRole.WEIGHT)
    full_scale = scaling.expand_scale(scale, tuple(weight.shape), block_size)
    scaled = weight * full_scale
    cast = scaling.quantize(weight, full_scale, dtype)
    nonzero = weight != 0
    underflow = (nonzero & (cast.float() == 0)).sum() / nonzero.sum().clamp(min=1)
    # The amax element lands on the max up to float32 rounding (448.00003): not a clip.
    saturated = (scaled.abs() > max_value(dtype) * (1 + _ROUNDING)).float().mean()
    return WeightCastStats(
        granularity=layer.recipe.granularity.value,
        gemms=layer.gemm_description,
        moves=tuple(layer.gemm_moves),
        scale=float(scale) if scale.numel() == 1 else None,
        scale_min=float(scale.amin()),
        scale_max=float(scale.amax()),
        amax=float(weight_amax),
        underflow=float(underflow),
        saturated=float(saturated),
    )


def _microscaled_cast_stats(layer: Fp8Linear, weight: torch.Tensor) -> WeightCastStats:
    """``weight_cast_stats`` of a microscaled layer: its forward GEMM's cast of ``weight``,
    the format (elements, block-scale dtype), the block and the range of the scales (as
    amp8 scales: ``element = real * scale``)."""
    cast = layer.cast(TensorRole.WEIGHT, weight, record=False)
    decode = cast.decode_scales()
    scales = decode[decode > 0].reciprocal()
    element_max = max_value(cast.dtype)
    nonzero = weight != 0
    underflow = (nonzero & (cast.dequantize() == 0)).sum() / nonzero.sum().clamp(min=1)
    scaled = weight.float().abs() / cast.full_scales()
    saturated = (scaled > element_max * (1 + _ROUNDING)).float().mean()
    elements = "e2m1" if is_fp4(cast.dtype) else SHORT_DTYPES[short_name(cast.dtype)]
    block_scales = "e8m0" if cast.scales.dtype == E8M0 else SHORT_DTYPES[short_name(cast.scales.dtype)]
    return WeightCastStats(
        granularity=layer.recipe.granularity.value,
        gemms=layer.gemm_description,
        moves=tuple(layer.gemm_moves),
        scale_min=float(scales.amin()) if scales.numel() else None,
        scale_max=float(scales.amax()) if scales.numel() else None,
        amax=float(scaling.amax(weight)),
        underflow=float(underflow),
        saturated=float(saturated),
        format=f"{layer.recipe.microscaling.value} {elements}/{block_scales}",
        block="x".join(map(str, cast.tile)),
    )
