"""Properties of quantize / dequantize over the whole finite float32 range (subnormals and
1e-45 included), for every storage format and every granularity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp8.config.formats import E4M3, E5M2
from amp8.quant import scaling

FORMATS = [E4M3, E5M2, torch.float16]
# Each granularity: ("tiles", tile of quantize_tiles: None, "row" or (rows, columns))
# or ("blockwise", block_size of quantize_blockwise: 0 for one block).
GRANULARITIES = {
    "tiles-tensorwise": ("tiles", None),
    "tiles-rowwise": ("tiles", "row"),
    "tiles-block": ("tiles", (4, 4)),
    "blockwise-tensorwise": ("blockwise", 0),
    "blockwise-block": ("blockwise", 4),
}
FLOAT32_EPS = 2.0**-23
HALF_FLOAT32_SUBNORMAL = 2.0**-150

full_range = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
# At and below 2**-120 the scale of every format overflows float32 and is clamped.
tiny = st.floats(min_value=-(2.0**-120), max_value=2.0**-120, width=32, allow_subnormal=True)


@st.composite
def matrices(draw: st.DrawFn) -> torch.Tensor:
    """A float32 (rows, cols) matrix, its elements from the whole finite range or all
    tiny (so that whole tiles sit far below 1)."""
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    element = draw(st.sampled_from([full_range, tiny]))
    values = draw(st.lists(element, min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(values, dtype=torch.float32).view(rows, cols)


def _tile_keys(shape: tuple[int, int], tile: tuple[int, int]) -> torch.Tensor:
    """Which tile each element of a matrix of ``shape`` is in, numbered row by row."""
    rows = torch.arange(shape[0])[:, None] // tile[0]
    cols = torch.arange(shape[1])[None, :] // tile[1]
    return rows * -(-shape[1] // tile[1]) + cols


def _quantize(
    x: torch.Tensor, dtype: torch.dtype, granularity: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, dequantized, scale of each element, amax of each element's tile)``; which
    scale and amax belong to an element is worked out here, apart from amp8."""
    kind, how = GRANULARITIES[granularity]
    if kind == "tiles":
        tile = None if how is None else ((1, x.shape[1]) if how == "row" else how)
        data, scales = scaling.quantize_tiles(x, dtype, tile)
        keys = _tile_keys(tuple(x.shape), tile or tuple(x.shape))
        restored = scaling.dequantize(data, scales.flatten()[keys])
    else:
        data, scales = scaling.quantize_blockwise(x, dtype, how)
        restored = scaling.dequantize_blockwise(data, scales, how)
        keys = torch.arange(x.numel()).view(x.shape) // (how or x.numel())
    tile_amax = torch.zeros(scales.numel()).scatter_reduce(0, keys.flatten(), x.abs().flatten(), "amax")
    return data, restored, scales.flatten()[keys], tile_amax[keys]


def _format_limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """``(max, smallest subnormal, largest relative rounding error of a normal value)``."""
    info = torch.finfo(dtype)
    return float(info.max), float(info.tiny) * float(info.eps), float(info.eps) / 2


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=matrices())
def test_quantize_dequantize_over_the_float32_range(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> None:
    data, restored, scale, tile_amax = _quantize(x, dtype, granularity)
    top, subnormal, relative = _format_limits(dtype)
    assert not torch.isnan(data.float()).any(), f"NaN from finite input {x}"
    assert not torch.isnan(restored).any(), f"NaN after dequantizing finite input {x}"

    # Each tile's scale takes its amax to the format's max, or is MAX_SCALE when that
    # would overflow; an all-zero tile keeps the scale 1.
    used = tile_amax.double() * scale.double()
    fills_range = (used >= top * (1 - FLOAT32_EPS)) & (used <= top * (1 + FLOAT32_EPS))
    ok_scale = torch.where(tile_amax > 0, fills_range | (scale == scaling.MAX_SCALE), scale == 1.0)
    assert ok_scale.all(), f"scales {scale[~ok_scale]} for tile amax {tile_amax[~ok_scale]}"

    # Rounding: within half a unit in the last place where the scaled value is normal,
    # within half the smallest subnormal below that.
    scaled = x.double() * scale.double()
    error = (data.double() - scaled).abs()
    bound = torch.maximum(relative * scaled.abs(), torch.tensor(subnormal / 2)) + FLOAT32_EPS * scaled.abs()
    assert (error <= bound).all(), f"{x[error > bound]} -> {data[error > bound]} with scales {scale[error > bound]}"

    flushed = (data.float() == 0) & (x != 0)
    assert (scaled[flushed].abs() < subnormal).all(), f"{x[flushed]} became zero above the smallest subnormal"

    back = (restored.double() - x.double()).abs()
    back_bound = bound / scale.double() + FLOAT32_EPS * x.double().abs() + HALF_FLOAT32_SUBNORMAL
    assert (back <= back_bound).all(), f"{x[back > back_bound]} came back as {restored[back > back_bound]}"
