"""Counter-based noise: the eager int32 hash and the int64 hash torch.compile runs give
the same bits, equal to the hash computed on Python ints."""

import pytest
import torch

from amp8.quant import noise


def _int64_uniform(numel: int, key: int) -> torch.Tensor:
    """The noise as torch.compile computes it: int64 words, no overflow."""
    index = torch.arange(numel, dtype=torch.int64)
    bits = noise.hash32(key ^ (index & 0xFFFFFFFF))
    return (bits >> 8).to(torch.float32) * 2.0**-24


@pytest.mark.parametrize("key", [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, noise.rounding_key(3, 5)])
@pytest.mark.parametrize("numel", [1, 7, 33, 1000, 65_537])
def test_eager_noise_equals_the_int64_hash(key: int, numel: int) -> None:
    eager = noise.uniform((numel,), key, torch.device("cpu"))
    assert torch.equal(eager.view(torch.int32), _int64_uniform(numel, key).view(torch.int32))


@pytest.mark.parametrize("key", [0x80000001, noise.rounding_key(0, 0)])
def test_eager_noise_equals_the_hash_of_python_ints(key: int) -> None:
    eager = noise.uniform((5,), torch.tensor(key, dtype=torch.int64), torch.device("cpu"))
    expected = [(noise.hash32(key ^ i) >> 8) * 2.0**-24 for i in range(5)]
    assert eager.tolist() == expected


@pytest.mark.compile
def test_compiled_noise_equals_eager() -> None:
    key = torch.tensor(noise.rounding_key(7, 11), dtype=torch.int64)
    compiled = torch.compile(lambda k: noise.uniform((3, 300), k, torch.device("cpu")), backend="aot_eager")
    eager = noise.uniform((3, 300), key, torch.device("cpu"))
    assert torch.equal(compiled(key), eager)


@pytest.mark.compile
@pytest.mark.parametrize("key", [0, 0xFFFFFFFF, noise.rounding_key(3, 5)])
@pytest.mark.parametrize("stream", [1, 2])
def test_stream_keys_are_the_same_for_ints_tensors_and_compiled(key: int, stream: int) -> None:
    """A noise stream's key is one hash of the draw's key: the same word from a Python int,
    an int64 tensor and inside torch.compile, in range, and another than the draw's own."""
    from_int = noise.stream_key(key, stream)
    from_tensor = noise.stream_key(torch.tensor(key, dtype=torch.int64), stream)
    compiled = torch.compile(lambda k: noise.stream_key(k, stream), backend="aot_eager")
    assert 0 <= from_int < 2**32 and from_int != key
    assert int(from_tensor) == from_int == int(compiled(torch.tensor(key, dtype=torch.int64)))


def test_streams_of_one_key_are_uncorrelated() -> None:
    """Two tensors rounded in one update take streams 0 and 1 of its key: their noise is
    uncorrelated (under one key, element i of both would get the same bits)."""
    key = noise.rounding_key(5, 9)
    first = noise.uniform((100_000,), key, torch.device("cpu"))
    second = noise.uniform((100_000,), noise.stream_key(key, 1), torch.device("cpu"))
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1]
    assert abs(float(correlation)) < 0.02  # about 6 standard errors of independent noise
