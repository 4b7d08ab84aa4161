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
  reference optimizer step's time. ``tests/quant/test_noise.py`` checks both give equal
  bits.

The optimizer's update rounds two tensors of each parameter stochastically (its FP16 or
master weight and its FP8 first moment) and draws a fresh key per update, so its noise
needs less mixing than a hash of a fixed key: ``update_words`` is one 32-bit multiplication
of ``index ^ key`` (the key, a full ``lowbias32`` hash of seed and draw, carries the
randomness; the multiplication spreads neighbouring indices over the word), on int32 words
eagerly and uint32 words inside ``torch.compile`` (unsigned arithmetic wraps modulo
``2**32`` in the generated C++ and Triton: no 64-bit work). ``noise_field`` takes each
tensor's bits from its own bits of that word as a signed integer, which
``amp8.quant.scaling.quantize_with_noise`` adds to the value's bits before rounding to
nearest: 9 integer operations per element for both tensors, against 36 for two
``lowbias32`` words in int64 halves, and unbiased to within ``2**-19`` of a unit in the
last place (``noise_field``).
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


def _signed32(word: Word) -> Word:
    """The int32 value with the same bits as the 32-bit word ``word`` (an int, or an int64
    tensor of words)."""
    return word - ((word >> 31) << 32)


def _int32_index(numel: int, device: torch.device, width: int = 1024) -> torch.Tensor:
    """``arange(numel)`` as int32, built as rows plus columns (an int32 ``arange`` of
    millions of elements is several times slower on the CPU than this one add)."""
    rows = -(-numel // width)
    starts = torch.arange(rows, dtype=torch.int32, device=device).mul_(width)
    columns = torch.arange(width, dtype=torch.int32, device=device)
    return (starts[:, None] + columns).view(-1)[:numel]


def _hash32_int32_(x: torch.Tensor) -> torch.Tensor:
    """``hash32`` of int32 ``x`` (the words' bits, two's complement), in place, with one
    scratch tensor. Right shifts of int32 copy the sign bit, so each shifted word is
    masked to its width."""
    scratch = torch.empty_like(x)
    for shift, multiplier in ((16, _MULTIPLIERS[0]), (15, _MULTIPLIERS[1]), (16, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        x ^= scratch.bitwise_and_((1 << (32 - shift)) - 1)
        if multiplier is not None:
            x *= _signed32(multiplier)
    return x


def rounding_key(seed: int, counter: int) -> int:
    """The noise key of draw number ``counter`` of the stream seeded with ``seed``: an
    int in ``[0, 2**32)``. Both arguments are non-negative ints of any size.

    Raises:
        ValueError: a negative seed or counter.
    """
    if seed < 0 or counter < 0:
        raise ValueError(f"seed={seed} and counter={counter} must be >= 0 for a noise key")
    return draw_key(seed_key(seed), counter)


def seed_key(seed: int) -> int:
    """The part of every noise key that depends on the seed alone (see ``draw_key``)."""
    key = hash32(seed & _MASK32)
    return hash32(key ^ ((seed >> 32) & _MASK32))


def draw_key(seed_part: Word, counter: Word) -> Word:
    """``rounding_key(seed, counter)`` from ``seed_part = seed_key(seed)``: ints, or
    int64 tensors (draw numbers below ``2**63``) that give a tensor of keys with the same
    bits, eagerly and inside ``torch.compile``."""
    key = hash32((counter & _MASK32) ^ seed_part)
    return hash32(((counter >> 32) & _MASK32) ^ key)


def random_bits(shape: torch.Size | tuple[int, ...], key: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """32 random bits per element of ``shape``: element ``i`` (in row-major order) is
    ``hash(key, i)``, as int32 words (their bits, two's complement) eagerly and as int64
    words in ``[0, 2**32)`` inside ``torch.compile``. ``key`` is an int or an int64 scalar
    tensor in ``[0, 2**32)`` (a CPU scalar tensor works with tensors on any device)."""
    numel = 1
    for size in shape:
        numel *= size
    if not torch.compiler.is_compiling() and numel < 1 << 31:
        return _hash32_int32_(_int32_index(numel, device).bitwise_xor_(_signed32(int(key)))).view(shape)
    return random_bits_at(torch.arange(numel, dtype=torch.int64, device=device), key, numel).view(shape)


def random_bits_at(index: torch.Tensor, key: torch.Tensor | int, numel: int) -> torch.Tensor:
    """``random_bits``' words for the elements at ``index`` (int64, non-negative) of
    tensors of at most ``numel`` elements, each under its ``key`` (an int, or an int64
    tensor of keys that broadcasts against ``index``): many tensors' noise in one call,
    as ``random_bits`` gives it for each. int32 words eagerly where the indices fit in
    31 bits, int64 words otherwise."""
    if not torch.compiler.is_compiling() and numel < 1 << 31:
        signed_key = _signed32(key) if isinstance(key, int) else _signed32(key).to(torch.int32)
        return _hash32_int32_(index.to(torch.int32) ^ signed_key)
    bits = hash32(key ^ (index & _MASK32))
    if numel > _MASK32:  # elements past 2**32 mix in the high word of their index
        bits = hash32(bits ^ (index >> 32))
    return bits


_UPDATE_MULTIPLIER = 0x7FEB352D  # odd: multiplying by it permutes the 32-bit words
_FIELD_TOP_BIT = 18  # stream 1 takes the word's bits up to here (stream 0 the top ones)


def element_index(shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each element's row-major index in a tensor of ``shape``, as ``update_words`` takes
    it: int32 below ``2**31`` elements, else int64 (past ``2**32`` the words repeat)."""
    numel = 1
    for size in shape:
        numel *= size
    if numel < 1 << 31:
        return _int32_index(numel, device).view(shape)
    return (torch.arange(numel, dtype=torch.int64, device=device) & _MASK32).view(shape)


def update_words(index: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    """The 32-bit noise words of an optimizer update: ``((index ^ key) * M) mod 2**32``
    for element indices ``index`` (non-negative; past ``2**32`` the words repeat) under
    ``key`` (an int or an integer tensor that broadcasts against ``index``, in
    ``[0, 2**32)``). int32 words (their bits, two's complement) eagerly, uint32 words
    inside ``torch.compile`` (32-bit arithmetic whose products wrap), int64 words in
    ``[0, 2**32)`` where Inductor writes C++ (``_cpp_kernels``): the same bits."""
    if torch.compiler.is_compiling():
        if _cpp_kernels(index):  # int64 words in [0, 2**32): products below 2**63
            return ((index.to(torch.int64) ^ key) * _UPDATE_MULTIPLIER) & _MASK32
        unsigned_key = key & _MASK32 if isinstance(key, int) else key.to(torch.uint32)
        return (index.to(torch.uint32) ^ unsigned_key) * _UPDATE_MULTIPLIER
    signed_key = _signed32(key) if isinstance(key, int) else _signed32(key).to(torch.int32)
    if index.dtype != torch.int32:  # past 2**31 elements: the index's low 32 bits as int32
        index = _signed32(index & _MASK32).to(torch.int32)
    return (index ^ signed_key).mul_(_signed32(_UPDATE_MULTIPLIER))


def noise_field(words: torch.Tensor, stream: int, dropped: int) -> torch.Tensor:
    """The noise stochastic rounding adds to a value's bits before rounding to nearest
    (``amp8.quant.scaling.quantize_with_noise``): a signed int32 in
    ``[-2**(dropped - 1), 2**(dropped - 1))`` per word of ``update_words``, for the
    float32 mantissa bits a format drops (13 for FP16, 20 for E4M3). Stream 0 takes the
    word's top ``dropped`` bits (one arithmetic shift); stream 1 takes bits 0 to 18 at the
    top of its field (a shift each way, the left one as a multiplication), so the two
    tensors of one update round with bits of their own wherever stream 0's format drops
    at most 13 bits (FP16). A field wider than 19 bits has zeros below them: its rounding
    is unbiased to within ``2**(dropped - 19) / 2**dropped`` of a unit (``2**-19`` for
    E4M3)."""
    if stream not in (0, 1):
        raise ValueError(f"stream={stream} is not a noise field; use 0 or 1")
    if words.dtype == torch.int64:  # Inductor's C++ (``update_words``): the same field, no overflow
        if stream == 1:
            words = (words << (31 - _FIELD_TOP_BIT)) & _MASK32
        return ((words >> (32 - dropped)) - ((words >> 31) << dropped)).to(torch.int32)  # (sign-extended)
    if stream == 0:
        return words.view(torch.int32) >> (32 - dropped)
    # (a multiplication shifts left: torch has no eager left shift of uint32)
    return (words * (1 << (31 - _FIELD_TOP_BIT))).view(torch.int32) >> (32 - dropped)


def _cpp_kernels(index: torch.Tensor) -> bool:
    """Whether Inductor compiles the words of ``index`` to C++ (a CPU tensor, the default
    CPU backend), which leaves a loop holding uint32 values unvectorized (the compiled
    O1 update over 8M parameters took 5.6x as long): there the words are int64."""
    return index.device.type == "cpu" and torch._inductor.config.cpu_backend == "cpp"


def signed_top_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` (1 to 31) highest of the 32 bits in each word of ``random_bits`` as
    a signed integer in ``[-2**(count - 1), 2**(count - 1))`` (the noise
    ``amp8.quant.scaling.quantize_with_noise`` takes), int32 from int32 words (in place)
    and int64 from int64 ones, with the same values."""
    if bits.dtype == torch.int32:
        return bits.bitwise_right_shift_(32 - count) if not torch.compiler.is_compiling() else bits >> (32 - count)
    half = 1 << (count - 1)
    return ((bits >> (32 - count)) ^ half) - half


def top_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` (1 to 31) highest of the 32 bits in each word of ``random_bits``, as
    non-negative integers of the same dtype (in place of an eager int32 ``bits``)."""
    if not torch.compiler.is_compiling() and bits.dtype == torch.int32:  # our own words: in place
        return bits.bitwise_right_shift_(32 - count).bitwise_and_((1 << count) - 1)
    return (bits >> (32 - count)) & ((1 << count) - 1)


def uniform(shape: torch.Size | tuple[int, ...], key: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """float32 noise of ``shape`` in ``[0, 1)``, in steps of ``2**-24``: the top 24 of
    ``random_bits(shape, key, device)``."""
    return top_bits(random_bits(shape, key, device), _UNIFORM_BITS).to(torch.float32).mul_(2.0**-_UNIFORM_BITS)
