"""Storage of Adam's moments and master weights at the precisions of the level table.

A tensor kept in FP32 is stored under its key as is. A low-bit one is stored as ``key``
(FP8 or FP16 data), ``key + "_scale"`` (its scales) and ``key + "_layout"`` (its
``amp8.quant.codec.Layout`` as plain values), so a checkpoint decodes as it was saved.
Checkpoints of amp8 before layouts were saved hold ``key + "_block_size"`` instead; their
layout is read off the scales' shape once (``layout_of``).

Scales are one per tensor, per flat block of ``state_block_size`` elements, per row of a
matrix, or per tile of a matrix (the recipe's granularity for a weight; those may be
one-byte E8M0 powers of two, the MXFP8 recipe's moments). Adam's two moments of one
tensor always take the same tiles (``amp8.optim.stored_state``): a second moment with
coarser scales than its first flushes a row to zero where the first moment keeps it, and
``m / sqrt(v)`` explodes.

An FP8 first moment is rounded stochastically (``rounds_stochastically``), with noise
field 1 of its update's words (``amp8.quant.noise.noise_field``; the weight takes field 0).
"""

from __future__ import annotations

from typing import Any

import torch

from amp8.config.formats import E4M3
from amp8.config.levels import Precision
from amp8.quant.codec import FLOAT32, Layout, Tiling

_STORAGE_DTYPES = {Precision.FP8: E4M3, Precision.FP16: torch.float16}
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's moments, by their keys in the state
MASTER = "master"  # O3's master weight
SCALE_SUFFIX = "_scale"
LAYOUT_SUFFIX = "_layout"
_OLD_BLOCK_SUFFIX = "_block_size"  # checkpoints before layouts were saved
FIRST_MOMENT_STREAM = 1  # the noise field of the first moment's rounding (the weight's is 0)


def rounds_stochastically(key: str, precision: Precision) -> bool:
    """Whether ``state[key]`` at ``precision`` is stored with stochastic rounding: Adam's
    FP8 first moment. Rounded to nearest, with E4M3's 3 mantissa bits, the moving average
    drifts towards zero (on the tiny GPT, 0.8 % below a float32 average of the same
    gradients) and O2 ends about 1 % above O0 in loss; rounded stochastically it is
    unbiased and O2 ends where an FP32 first moment does (docs/recipes.md, "The defaults study":
    the ``-nearest-m`` runs)."""
    return key == MOMENTS[0] and precision is Precision.FP8


def moment_layout(
    key: str, precision: Precision, block_size: int, shape: tuple[int, ...],
    tile: tuple[int, int] | None = None, tile_scale_dtype: torch.dtype = torch.float32,
) -> Layout:
    """The layout of ``state[key]`` (of ``shape``) at ``precision``: one scale per ``tile``
    where a tile is given (a whole row of a matrix, or a tile kept as
    ``tile_scale_dtype``), else per flat block of ``block_size`` elements (0: per tensor)."""
    if precision is Precision.FP32:
        return FLOAT32
    dtype = _STORAGE_DTYPES[precision]
    stream = FIRST_MOMENT_STREAM if rounds_stochastically(key, precision) else None
    if tile is not None:  # E8M0 scales hold powers of two
        return Layout.for_tile(dtype, tile, shape, power_of_2=tile_scale_dtype != torch.float32,
                               scale_dtype=tile_scale_dtype, stream=stream)
    if block_size > 0:
        return Layout(dtype, Tiling.BLOCKS, block=block_size, stream=stream)
    return Layout(dtype, stream=stream)


def store(
    state: dict[str, Any], key: str, value: torch.Tensor, layout: Layout,
    scale: torch.Tensor | None = None, words: torch.Tensor | None = None,
) -> None:
    """Put float32 ``value`` into ``state[key]`` at ``layout`` (with its scales and the
    layout): with ``scale`` where given, else scales from its amaxes; stochastically under
    ``words`` where the layout has a noise stream."""
    data, scales = layout.encode(value, scale, words)
    put(state, key, data, scales, layout)


def put(state: dict[str, Any], key: str, data: torch.Tensor, scales: torch.Tensor | None, layout: Layout) -> None:
    """Keep encoded ``data`` and ``scales`` at ``layout`` as ``state[key]``."""
    state[key] = data
    state.pop(key + _OLD_BLOCK_SUFFIX, None)
    if scales is None:
        state.pop(key + SCALE_SUFFIX, None)
        state.pop(key + LAYOUT_SUFFIX, None)
        return
    state[key + SCALE_SUFFIX], state[key + LAYOUT_SUFFIX] = scales, layout.to_state()


def layout_of(state: dict[str, Any], key: str) -> Layout:
    """The layout ``state[key]`` is stored at: as saved, or for a checkpoint saved before
    layouts were, read off the dtype and the scales' shape (and saved from then on)."""
    saved = state.get(key + LAYOUT_SUFFIX)
    if saved is not None:
        return Layout.from_state(saved)
    data, scales = state[key], state.get(key + SCALE_SUFFIX)
    if scales is None:
        return FLOAT32
    block_size = int(state.pop(key + _OLD_BLOCK_SUFFIX, 0))
    stream = FIRST_MOMENT_STREAM if key == MOMENTS[0] and data.dtype == E4M3 else None
    power_of_2 = scales.dtype != torch.float32
    if scales.dim() == 0:
        layout = Layout(data.dtype, stream=stream)
    elif scales.dim() == 1:
        layout = Layout(data.dtype, Tiling.BLOCKS, block=block_size, stream=stream)
    elif data.dim() == 2 and tuple(scales.shape) == (data.shape[0], 1) and not power_of_2:
        layout = Layout(data.dtype, Tiling.ROWS, stream=stream)
    else:
        layout = Layout(data.dtype, Tiling.TILES, tile=(block_size, block_size), power_of_2=power_of_2,
                        scale_dtype=scales.dtype, stream=stream)
    state[key + LAYOUT_SUFFIX] = layout.to_state()
    return layout


def load(state: dict[str, Any], key: str) -> torch.Tensor:
    """The float32 values of ``state[key]``, whatever precision it is stored at."""
    return layout_of(state, key).decode(state[key], state.get(key + SCALE_SUFFIX))


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
