"""Storage of Adam's moments and master weights at the precisions of the level table.

A tensor kept in FP32 is stored under its key as is. A low-bit one is stored as
``key`` (FP8 or FP16 data), ``key + "_scale"`` (float32 scales, one per block of
``block_size`` elements, or one for the tensor when ``block_size`` is 0) and
``key + "_block_size"`` (that int, so a checkpoint decodes whatever it was saved with).

A low-bit matrix may instead take one scale per ``tile`` (rows, columns), the recipe's
granularity for a weight: its scales are then 2-D, ``(ceil(R / rows), ceil(C / columns))``,
and ``key + "_block_size"`` holds the larger tile edge. Those scales may be stored as
one-byte E8M0 powers of two (the MXFP8 recipe's moments). Adam's two moments of one
tensor always take the same tiles (``amp8.optim.stored_state``): a second moment with
coarser scales than its first flushes a row to zero where the first moment keeps it, and
``m / sqrt(v)`` explodes.

An FP8 first moment is rounded stochastically (``rounds_stochastically``), under noise
stream ``FIRST_MOMENT_STREAM`` of its update's key.
"""

from __future__ import annotations

from typing import Any

import torch

from amp8.config.formats import E4M3
from amp8.config.levels import Precision
from amp8.quant import noise, scaling

_STORAGE_DTYPES = {Precision.FP8: E4M3, Precision.FP16: torch.float16}
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's moments, by their keys in the state
MASTER = "master"  # O3's master weight
SCALE_SUFFIX = "_scale"
BLOCK_SUFFIX = "_block_size"
FIRST_MOMENT_STREAM = 1  # ``noise.stream_key`` stream of the first moment's rounding (the weight's is 0)


def rounds_stochastically(key: str, precision: Precision) -> bool:
    """Whether ``state[key]`` at ``precision`` is stored with stochastic rounding: Adam's
    FP8 first moment. Rounded to nearest, with E4M3's 3 mantissa bits, the moving average
    drifts towards zero (on the tiny GPT, 0.8 % below a float32 average of the same
    gradients) and O2 ends about 1 % above O0 in loss; rounded stochastically it is
    unbiased and O2 ends where an FP32 first moment does (docs/recipes.md, "The defaults study":
    the ``-nearest-m`` runs)."""
    return key == MOMENTS[0] and precision is Precision.FP8


def store(
    state: dict[str, Any],
    key: str,
    value: torch.Tensor,
    precision: Precision,
    block_size: int,
    tile: tuple[int, int] | None = None,
    tile_scale_dtype: torch.dtype = torch.float32,
    noise_key: torch.Tensor | int | None = None,
) -> None:
    """Put float32 ``value`` into ``state[key]`` at ``precision`` (with its scales): one
    scale per ``tile`` where a tile is given, stored as ``tile_scale_dtype``
    (E8M0: power-of-two scales in one byte), else per flat block of ``block_size``
    elements (0: per tensor). Where ``rounds_stochastically(key, precision)`` and a
    ``noise_key`` (the update's) is given, the values round stochastically under its
    stream ``FIRST_MOMENT_STREAM``; else to nearest."""
    if precision is Precision.FP32:
        state[key] = value
        state.pop(key + SCALE_SUFFIX, None)
        state.pop(key + BLOCK_SUFFIX, None)
        return
    if noise_key is not None and rounds_stochastically(key, precision):
        noise_key = noise.stream_key(noise_key, FIRST_MOMENT_STREAM)
    else:
        noise_key = None
    if tile is not None:
        power_of_2 = tile_scale_dtype is not torch.float32
        data, scales = scaling.quantize_tiles(
            value, _STORAGE_DTYPES[precision], tile, power_of_2=power_of_2, noise_key=noise_key
        )
        scales, block_size = scales.to(tile_scale_dtype), max(tile)
    else:
        data, scales = scaling.quantize_blockwise(value, _STORAGE_DTYPES[precision], block_size, noise_key)
    state[key], state[key + SCALE_SUFFIX], state[key + BLOCK_SUFFIX] = data, scales, block_size


def load(state: dict[str, Any], key: str) -> torch.Tensor:
    """The float32 values of ``state[key]``, whatever precision it is stored at."""
    data = state[key]
    scales = state.get(key + SCALE_SUFFIX)
    if scales is None:
        return data.float()
    block_size = state.get(key + BLOCK_SUFFIX, 0)
    if scales.dim() == data.dim() >= 2:  # one scale per tile
        return scaling.dequantize(data, scaling.expand_scale(scales.float(), tuple(data.shape), block_size))
    return scaling.dequantize_blockwise(data, scales, block_size)


def stored_precision(state: dict[str, Any], key: str) -> Precision:
    """The precision ``state[key]`` is stored at, read off its dtype."""
    dtype = state[key].dtype
    for precision, storage_dtype in _STORAGE_DTYPES.items():
        if dtype == storage_dtype:
            return precision
    return Precision.FP32


def low_bit_moments(state: dict[str, Any]) -> bool:
    """Whether either of Adam's moments in ``state`` is stored below float32: its step is
    then held to Adam's bound (``amp8.optim.bound``)."""
    return any(stored_precision(state, key) is not Precision.FP32 for key in MOMENTS)
