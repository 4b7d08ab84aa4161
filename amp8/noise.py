"""Counter-based uniform noise for stochastic rounding.

The noise of element ``i`` is a hash of ``(key, i)``, where ``key`` is itself a hash of a
seed and a counter (``rounding_key``). Nothing is drawn from a ``torch.Generator``: the
same key gives the same bits on every device, eagerly or inside a ``torch.compile`` graph,
and a checkpoint only needs the seed and the counter to resume the same noise.

The hash is Chris Wellons' ``lowbias32`` on 32-bit words. Every operand is kept below
``2**32`` and every product below ``2**49``, so the int64 arithmetic never overflows
(signed overflow is undefined in the C++ and Triton code torch.compile generates).
"""

from __future__ import annotations

from typing import TypeVar

import torch

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
_UNIFORM_BITS = 24  # float32 holds every multiple of 2**-24 in [0, 1) exactly

Word = TypeVar("Word", int, torch.Tensor)


def _mul32(x: Word, constant: int) -> Word:
    """``(x * constant) mod 2**32`` for ``x < 2**32``, in halves of the constant so no
    product reaches 2**49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def hash32(x: Word) -> Word:
    """A 32-bit avalanche hash of ``x`` (an int or int64 tensor holding values in
    ``[0, 2**32)``); the result is in the same range."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MULTIPLIERS[1])
    return x ^ (x >> 16)


def rounding_key(seed: int, counter: int) -> int:
    """The noise key of draw number ``counter`` of the stream seeded with ``seed``: an
    int in ``[0, 2**32)``. Both arguments are non-negative ints of any size.

    Raises:
        ValueError: a negative seed or counter.
    """
    if seed < 0 or counter < 0:
        raise ValueError(f"seed={seed} and counter={counter} must be >= 0 for a noise key")
    key = hash32(seed & _MASK32)
    key = hash32(key ^ ((seed >> 32) & _MASK32))
    key = hash32(key ^ (counter & _MASK32))
    return hash32(key ^ ((counter >> 32) & _MASK32))


def uniform(shape: torch.Size | tuple[int, ...], key: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """float32 noise of ``shape`` in ``[0, 1)``, in steps of ``2**-24``: element ``i`` (in
    row-major order) is ``hash(key, i)``. ``key`` is an int or an int64 scalar tensor in
    ``[0, 2**32)`` (a CPU scalar tensor works with tensors on any device)."""
    numel = 1
    for size in shape:
        numel *= size
    index = torch.arange(numel, dtype=torch.int64, device=device)
    bits = hash32(key ^ (index & _MASK32))
    if numel > _MASK32:  # elements past 2**32 mix in the high word of their index
        bits = hash32(bits ^ (index >> 32))
    return (bits >> (32 - _UNIFORM_BITS)).to(torch.float32).mul(2.0**-_UNIFORM_BITS).view(shape)
