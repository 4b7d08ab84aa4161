"""Counter-based uniform noise for stochastic rounding.

The noise of element ``i`` is a hash of ``(key, i)``, where ``key`` is itself a hash of a
seed and a counter (``rounding_key``). Nothing is drawn from a ``torch.Generator``: the
same key gives the same bits on every device, eagerly or inside a ``torch.compile`` graph,
and a checkpoint only needs the seed and the counter to resume the same noise.

The hash is Chris Wellons' ``lowbias32`` on 32-bit words, computed two ways that give the
same bits:

- inside ``torch.compile`` on int64 words, with every operand below ``2**32`` and every
  product below ``2**49``, so nothing overflows (signed overflow is undefined in the C++
  and Triton code torch.compile generates);
- eagerly on int32 words, in place, where torch's integer kernels multiply modulo
  ``2**32``: about five times less work and memory traffic, which is most of the
  reference optimizer step's time. ``tests/test_noise.py`` checks both give equal bits.
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


def _signed32(word: int) -> int:
    """The int32 with the same bits as the 32-bit word ``word``."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _hash32_int32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` of int32 ``x`` (the words' bits, two's complement), in place. Right
    shifts of int32 copy the sign bit, so each shifted word is masked to its width."""
    x ^= (x >> 16) & 0xFFFF
    x *= _signed32(_MULTIPLIERS[0])
    x ^= (x >> 15) & 0x1FFFF
    x *= _signed32(_MULTIPLIERS[1])
    x ^= (x >> 16) & 0xFFFF
    return x


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
    shift, scale = 32 - _UNIFORM_BITS, 2.0**-_UNIFORM_BITS
    if not torch.compiler.is_compiling() and numel < 1 << 31:
        index = torch.arange(numel, dtype=torch.int32, device=device)
        bits = _hash32_int32_(index.bitwise_xor_(_signed32(int(key))))
        top = bits.bitwise_right_shift_(shift).bitwise_and_((1 << _UNIFORM_BITS) - 1)
        return top.to(torch.float32).mul_(scale).view(shape)
    index = torch.arange(numel, dtype=torch.int64, device=device)
    bits = hash32(key ^ (index & _MASK32))
    if numel > _MASK32:  # elements past 2**32 mix in the high word of their index
        bits = hash32(bits ^ (index >> 32))
    return (bits >> shift).to(torch.float32).mul(scale).view(shape)
