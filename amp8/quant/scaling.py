"""Scales, amax and the FP8 cast, as pure functions.

A tensor ``x`` with absolute maximum ``amax`` is stored as ``saturate(x * scale)`` with
``scale = fp8_max / amax / 2**margin`` (optionally rounded down to a power of two).
Dequantizing divides by the scale; GEMMs are handed ``1 / scale``. An amax that is zero,
inf or NaN keeps the previous scale, so one bad tensor cannot poison later casts. An amax
so small that its scale would overflow float32 gets ``MAX_SCALE`` instead, so a tiny
tensor still lands on the format's nonzero values where its scaled values reach them.
"""

from __future__ import annotations

import math

import torch

from amp8.config.formats import max_value
from amp8.config.recipe import AmaxAlgo
from amp8.quant import noise

MAX_SCALE: float = 1.0 / float(torch.finfo(torch.float32).tiny)
"""The largest scale amp8 uses, 2**126: the largest power of two whose reciprocal (what
a GEMM is given) is still a normal float32, which GPUs do not flush to zero."""


def amax(x: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of ``x`` as a float32 scalar tensor (NaN if ``x`` has one).

    An empty ``x`` (an empty batch) has amax 0, which keeps the previous scale."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def scale_from_amax(
    amax_value: torch.Tensor,
    dtype: torch.dtype,
    *,
    margin: int = 0,
    power_of_2: bool = False,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 scale that maps ``amax_value`` to the largest value of ``dtype``.

    Args:
        amax_value: float32 absolute maximum (any shape; scales come out elementwise).
        dtype: the target dtype (FP8 or FP16); its max comes from ``torch.finfo``.
        margin: divide the scale by ``2**margin``.
        power_of_2: round the scale down to a power of two.
        previous: scale kept where ``amax_value`` is zero or not finite (default 1).

    A scale beyond ``MAX_SCALE`` (an amax below about 1e-36, or a tiny float32
    subnormal) is clamped to it rather than overflowing float32.
    """
    amax_value = amax_value.float()
    # A tensor numerator: ``float / tensor`` would multiply by a rounded reciprocal.
    scale = torch.full_like(amax_value, max_value(dtype)) / amax_value / (2.0**margin)
    scale = scale.clamp(max=2.0**126)  # MAX_SCALE, a literal for the reason in formats.max_value
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fallback = torch.ones_like(scale) if previous is None else previous.float().expand_as(scale)
    usable = torch.isfinite(amax_value) & (amax_value > 0)
    return torch.where(usable, scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``dtype``.

    Finite values beyond the format's max clip to it, also where ``x * scale`` overflows
    float32; inf and NaN in ``x`` become NaN, so an overflow upstream stays visible after
    the cast (the CPU's own cast would saturate an inf to the max of E4M3FN, which has
    no inf).
    """
    return saturate(x, scale, dtype).to(dtype)


def saturate(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, clipped to ``dtype``'s finite range where ``x`` and
    ``scale`` are finite and NaN where either is not: what ``quantize`` casts (a caller
    that casts into memory it has takes this)."""
    x = x.float()
    # (x * 0) * scale is zero where x and the scale are finite and NaN where either is not:
    # adding it marks the values that clipping does not (a select on a bool mask costs
    # several times more on the CPU). In this order a compiled block's forward and backward
    # split as without the scale; as x * (scale * 0), the gpt-1b blocks' backwards redid
    # 80 of their forwards' kernels (bench/step_profile.py).
    return _clip(x * scale, max_value(dtype)).add_((x * 0.0) * scale)


def _clip(values: torch.Tensor, limit: float) -> torch.Tensor:
    """``values`` clipped to ``[-limit, limit]``; a NaN goes to a bound or stays (the
    caller marks it): by ``clip_by_fmax`` where ``clips_by_fmax``, else by ``clamp``."""
    if clips_by_fmax(values):
        return clip_by_fmax(values, limit)
    return values.clamp_(-limit, limit)


def clips_by_fmax(values: torch.Tensor) -> bool:
    """Whether ``saturate`` clips ``values`` by ``fmax`` and ``fmin``: in compiled code, on
    every device but the CPU. On a GPU each is one instruction, where torch's NaN-keeping
    ``clamp`` takes a compare, a NaN test and a select per bound; eagerly they would be two
    kernels where ``clamp_`` is one; Inductor's C++ runs ``clamp`` as one vector operation
    per bound and ``fmax`` as several (the compiled O2 step over 4M parameters took 1.3x as
    long with them)."""
    return values.device.type != "cpu" and torch.compiler.is_compiling()


def clip_by_fmax(values: torch.Tensor, limit: float) -> torch.Tensor:
    """``values`` clipped to ``[-limit, limit]`` by ``fmax`` and ``fmin``, NaN to ``-limit``."""
    bound = values.new_full((), limit)
    return torch.fmin(torch.fmax(values, -bound), bound)


def quantize_stochastic(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, noise_key: torch.Tensor | int
) -> torch.Tensor:
    """``x * scale`` rounded to ``dtype`` (FP16, BF16 or FP8) up or down at random, with
    the probability that makes the expected result exact.

    Rounding to nearest drops every update smaller than half a unit in the last place;
    stochastic rounding keeps it on average, so a long run of tiny updates lands where a
    float32 run lands. Saturates like ``quantize``: finite values clip to the max, inf
    and NaN become NaN. The randomness is counter-based (``amp8.quant.noise.random_bits``)
    under ``noise_key`` (an int or int64 scalar tensor in ``[0, 2**32)``, see
    ``amp8.quant.noise.rounding_key``): the same key gives the same bits eagerly and inside
    ``torch.compile``, on any device.

    Raises:
        TypeError: ``noise_key`` is not an int or a tensor (a ``torch.Generator`` from
            older amp8 code: pass ``amp8.quant.noise.rounding_key(seed, counter)`` instead).
    """
    if isinstance(noise_key, bool) or not isinstance(noise_key, (int, torch.Tensor)):
        raise TypeError(
            f"noise_key must be an int or an int64 scalar tensor, got {type(noise_key).__name__}; "
            "stochastic rounding is counter-based: pass amp8.quant.noise.rounding_key(seed, counter)"
        )
    bits = noise.random_bits(x.shape, noise_key, x.device)
    return quantize_with_noise(x, scale, dtype, noise.signed_top_bits(bits, dropped_bits(dtype)))


def dropped_bits(dtype: torch.dtype) -> int:
    """The float32 mantissa bits ``dtype`` lacks: 13 (FP16), 16 (BF16), 20 (E4M3), 21 (E5M2)."""
    return 23 - round(-math.log2(torch.finfo(dtype).eps))


def quantize_with_noise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """``quantize_stochastic`` with its noise given: a signed integer in
    ``[-2**(dropped - 1), 2**(dropped - 1))`` per element of ``x`` (``dropped_bits(dtype)``;
    ``amp8.quant.noise.signed_top_bits`` of its words, or an optimizer update's
    ``noise_field``), so many tensors stored in one buffer round as each would alone."""
    scaled = saturate(x, scale, dtype)
    info = torch.finfo(dtype)
    # Below dtype's smallest normal its spacing stays that of the smallest binade: moved up
    # by that binade's power of two, a value rounds like a normal number and moves back exactly.
    offset = (scaled.abs() < info.tiny).to(torch.float32).mul_(info.tiny).copysign_(scaled)
    moved = scaled.add_(offset).view(torch.int32)  # ``scaled`` is this function's own tensor
    # The noise moves the magnitude's bits by less than half the unit of the dropped bits
    # either way, and the conversion rounds to nearest: a value whose dropped bits are
    # ``b`` units of ``2**-dropped`` rounds up for ``b`` of the ``2**dropped`` noise values,
    # so unbiased. Setting the lowest bit leaves no value halfway between two neighbours (a
    # tie, rounded to even), which would otherwise bias the rounding by one noise value.
    noisy = moved.add_(noise).bitwise_or_(1).view(torch.float32)
    return noisy.sub_(offset).to(dtype)


def quantize_rounded(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, noise_key: torch.Tensor | int | None = None
) -> torch.Tensor:
    """``quantize`` (to nearest) without a ``noise_key``, ``quantize_stochastic`` under one."""
    if noise_key is None:
        return quantize(x, scale, dtype)
    return quantize_stochastic(x, scale, dtype, noise_key)


def quantize_blockwise(
    x: torch.Tensor, dtype: torch.dtype, block_size: int, noise_key: torch.Tensor | int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flattened ``x`` in blocks of ``block_size`` elements, each with its own
    scale from its own amax, rounding stochastically under ``noise_key`` when one is
    given. Returns ``(data shaped like x, scales of shape (blocks,))``; ``block_size=0``
    means one block (a tensorwise scale, shape ())."""
    if block_size == 0:
        scale = scale_from_amax(amax(x), dtype)
        return quantize_rounded(x, scale, dtype, noise_key), scale
    blocks = as_blocks(x.float(), block_size)
    scales = scale_from_amax(blocks.abs().amax(dim=1), dtype)
    data = quantize_rounded(blocks, scales[:, None], dtype, noise_key)
    return data.flatten()[: x.numel()].view(x.shape), scales


def dequantize_blockwise(data: torch.Tensor, scales: torch.Tensor, block_size: int, *,
                         power_of_2: bool = False) -> torch.Tensor:
    """The float32 values of ``quantize_blockwise(x, dtype, block_size)``'s output
    (``power_of_2``: as ``dequantize``'s)."""
    if block_size == 0:
        return dequantize(data, scales, power_of_2=power_of_2)
    blocks = dequantize(as_blocks(data.float(), block_size), scales[:, None], power_of_2=power_of_2)
    return blocks.flatten()[: data.numel()].view(data.shape)


def as_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` flattened, zero-padded to a multiple of ``block_size``, as (blocks, block_size)."""
    flat = x.flatten()
    missing = -flat.numel() % block_size
    if missing:
        flat = torch.cat([flat, flat.new_zeros(missing)])
    return flat.view(-1, block_size)


def tile_amax(x: torch.Tensor, tile: tuple[int, int] | None) -> torch.Tensor:
    """The float32 absolute maximum of each ``tile`` (rows, columns) of the 2-D ``x``,
    shape ``(ceil(R / rows), ceil(C / columns))``; trailing partial tiles get their own
    amax. ``tile=None`` gives ``amax(x)`` (one scalar for the tensor). A stack of
    matrices (B..., R, C), such as a mixture of experts' weights, gets each matrix's
    tiles: shape ``(B..., ceil(R / rows), ceil(C / columns))``.

    An empty dimension (an empty batch) counts as one empty tile, whose amax is 0 as
    ``amax`` gives for an empty tensor: a size-1 dimension of scales broadcasts to the
    empty one, and the result is never empty itself."""
    if tile is None:
        return amax(x)
    if x.dim() < 2:
        raise ValueError(f"tiled scales need a 2-D tensor, got shape {tuple(x.shape)}")
    leading = tuple(x.shape[:-2])
    if x.numel() == 0:
        counts = [max(1, -(-size // max(1, edge))) for size, edge in zip(x.shape[-2:], tile)]
        return torch.zeros((*leading, *counts), dtype=torch.float32, device=x.device)
    tile_rows, tile_cols = tile
    absolute = x.detach().float().abs()
    # A dimension one tile spans is reduced to a size of 1 that compiled code knows is 1: as
    # the padded size over the tile's it would be a formula equal to 1, and Inductor (torch
    # 2.11-2.13) broadcasts a value computed from such scales as if the dimension were
    # the tensor's own size (docs/decisions.md, 2026-11-30).
    if x.shape[-2] <= tile_rows:
        absolute, tile_rows = absolute.amax(dim=-2, keepdim=True), 1
    if x.shape[-1] <= tile_cols:
        absolute, tile_cols = absolute.amax(dim=-1, keepdim=True), 1
    padded = torch.nn.functional.pad(absolute, (0, -absolute.shape[-1] % tile_cols, 0, -absolute.shape[-2] % tile_rows))
    rows, cols = padded.shape[-2:]
    tiles = padded.view(*leading, rows // tile_rows, tile_rows, cols // tile_cols, tile_cols)
    return tiles.amax(dim=(-3, -1))


def matrix_tile(tile: tuple[int, int] | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The tile a tensor of ``shape`` takes for ``tile``, the tile of one matrix: ``tile``
    for a matrix; for a stack of matrices (a mixture of experts' (E, N, K) weights), one
    scale per tensor (``tile=None``) becomes one per matrix, so no expert's scale depends
    on another's values."""
    if tile is None and len(shape) > 2:
        return (shape[-2], shape[-1])
    return tile


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block_size: int = 0) -> torch.Tensor:
    """``scale`` made to broadcast against a tensor of ``shape``.

    A scalar, or a dimension of size 1 or of the tensor's own size, broadcasts as it is;
    any other dimension holds one scale per ``block_size`` elements (the last block may
    be partial) and is repeated to the tensor's size.

    Raises:
        ValueError: a scale shape that does not tile ``shape`` with ``block_size``.
    """
    if scale.dim() == 0:
        return scale
    if scale.dim() != len(shape):
        raise ValueError(f"scales of shape {tuple(scale.shape)} do not fit a tensor of shape {tuple(shape)}")
    for dim, (count, size) in enumerate(zip(scale.shape, shape)):
        if count in (1, size):
            continue
        if block_size <= 0 or -(-size // block_size) != count:
            raise ValueError(
                f"scales of shape {tuple(scale.shape)} do not tile a tensor of shape "
                f"{tuple(shape)} in blocks of {block_size}; pass the block size they were made with"
            )
        scale = scale.repeat_interleave(block_size, dim).narrow(dim, 0, size)
    return scale


def quantize_tiles(
    x: torch.Tensor,
    dtype: torch.dtype,
    tile: tuple[int, int] | None,
    *,
    margin: int = 0,
    power_of_2: bool = False,
    noise_key: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the 2-D ``x`` with one scale per ``tile`` (rows, columns), each from its
    own amax, rounding stochastically under ``noise_key`` when one is given; ``tile=None``
    means one scale for the tensor. Returns ``(data, scales)`` with scales of shape
    ``(ceil(R / rows), ceil(C / columns))`` (or ``()``)."""
    scale = scale_from_amax(tile_amax(x, tile), dtype, margin=margin, power_of_2=power_of_2)
    block_size = 0 if tile is None else max(tile)
    return quantize_rounded(x, expand_scale(scale, tuple(x.shape), block_size), dtype, noise_key), scale


_NONFINITE_FROM = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}
"""The smallest positive byte of an FP8 format that is inf or NaN: E4M3FN's NaN (it has no
inf), E5M2's inf. Every byte from it up to 0x7F is inf or NaN, and so is every byte from
it | 0x80 up to 0xFF (the same values, negative)."""


_SMALL_ELEMENTS = 1 << 14
"""Tensors up to this many elements that ``all_finite`` concatenates before reading."""


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A bool scalar tensor: True when no tensor holds an inf or NaN. An FP8 tensor is read
    as its bytes, twice, with no temporary: its largest byte as int8 (the positive values:
    inf and NaN are the largest codes) and as uint8 (the negative ones). The others take
    one multi-tensor absolute max (inf or NaN exactly where one of the values is)."""
    finite = []
    wide = []
    small: dict[tuple[torch.dtype, torch.Size], list[torch.Tensor]] = {}
    for tensor in tensors:
        first = _NONFINITE_FROM.get(tensor.dtype)
        if first is not None:
            if tensor.numel():
                finite.append(tensor.view(torch.int8).amax() < first)
                finite.append(tensor.view(torch.uint8).amax() < (first | 0x80))
        elif tensor.numel():
            tensor = tensor if tensor.element_size() > 1 else tensor.float()
            if tensor.numel() <= _SMALL_ELEMENTS and tensor.dim():
                small.setdefault((tensor.dtype, tensor.shape[1:]), []).append(tensor)
            else:
                wide.append(tensor)
    # Many small tensors (biases, norms) are read as one: where a multi-tensor kernel runs
    # one tensor at a time (the CPU), the concatenation costs less than a call for each.
    wide += [torch.cat(alike) if len(alike) > 1 else alike[0] for alike in small.values()]
    if wide:
        finite.append(torch.isfinite(torch.stack(torch._foreach_norm(wide, math.inf)).float()).all())
    if not finite:
        return torch.tensor(True)
    return torch.stack(finite).all()


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *, power_of_2: bool = False
) -> torch.Tensor:
    """The real values ``data / scale``, in ``dtype``. With ``power_of_2`` (every scale a
    power of two, whose reciprocal float32 holds exactly), computed as ``data * (1 /
    scale)``: the same number, bit for bit, by one multiplication an element (a GPU
    divides in several instructions), the reciprocal taken once per scale."""
    values = data.float() * scale.reciprocal() if power_of_2 else data.float() / scale
    return values.to(dtype)


def history_amax(history: torch.Tensor, algo: AmaxAlgo) -> torch.Tensor:
    """Reduce an amax history (newest first, last dim) to one amax per row."""
    if algo is AmaxAlgo.MOST_RECENT:
        return history[..., 0]
    return history.amax(dim=-1)


def push_history(history: torch.Tensor, new_amax: torch.Tensor) -> torch.Tensor:
    """The history with ``new_amax`` as its newest entry and the oldest dropped."""
    return torch.cat([new_amax.reshape(history.shape[:-1] + (1,)), history[..., :-1]], dim=-1)


def sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approximation`` against ``reference``, in dB."""
    reference = reference.detach().double()
    noise = approximation.detach().double() - reference
    return float(10 * torch.log10(reference.pow(2).sum() / noise.pow(2).sum()))
