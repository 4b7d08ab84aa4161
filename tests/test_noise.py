"""Counter-based noise: the eager int32 hash and the int64 hash torch.compile runs give
the same bits, equal to the hash computed on Python ints."""

import pytest
import torch

from amp8 import noise


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


def test_compiled_noise_equals_eager() -> None:
    key = torch.tensor(noise.rounding_key(7, 11), dtype=torch.int64)
    compiled = torch.compile(lambda k: noise.uniform((3, 300), k, torch.device("cpu")), backend="aot_eager")
    eager = noise.uniform((3, 300), key, torch.device("cpu"))
    assert torch.equal(compiled(key), eager)
