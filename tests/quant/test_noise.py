"""Counter-based noise: the eager int32 hash and the int64 hash torch.compile runs give
the same bits, equal to the hash computed on Python ints; an update's 32-bit words and
fields are the same eagerly (int32) and compiled (uint32)."""

import pytest
import torch

from amp8.quant import noise
from conftest import cuda_fp8


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
@pytest.mark.parametrize("cpu_backend", ["triton", "cpp"], ids=["uint32 words", "int64 words"])
@pytest.mark.parametrize("key", [0, 0x7FFFFFFF, 0xFFFFFFFF, noise.rounding_key(3, 5)])
@pytest.mark.parametrize("stream, dropped", [(0, 13), (0, 20), (1, 20), (1, 21)])
def test_update_noise_fields_are_the_same_eager_and_compiled(key: int, stream: int, dropped: int,
                                                             cpu_backend: str) -> None:
    """An update's noise field: the same integers from the eager int32 words and from the
    words torch.compile computes (uint32 for Triton kernels, int64 for Inductor's C++),
    each in ``[-2**(dropped - 1), 2**(dropped - 1))``."""
    index = noise.element_index((4, 257), torch.device("cpu"))
    eager = noise.noise_field(noise.update_words(index, key), stream, dropped)
    with torch._inductor.config.patch(cpu_backend=cpu_backend):
        compiled = torch.compile(lambda i, k: noise.noise_field(noise.update_words(i, k), stream, dropped),
                                 backend="aot_eager")(index, torch.tensor(key, dtype=torch.int64))
    assert eager.dtype == compiled.dtype == torch.int32
    assert torch.equal(eager, compiled)
    assert int(eager.min()) >= -(2 ** (dropped - 1)) and int(eager.max()) < 2 ** (dropped - 1)


def test_the_two_fields_of_one_update_word_are_uncorrelated() -> None:
    """The two tensors one update rounds (weight: field 0, first moment: field 1) take
    their noise from other bits of the same word: uncorrelated."""
    words = noise.update_words(noise.element_index((100_000,), torch.device("cpu")), noise.rounding_key(5, 9))
    first = noise.noise_field(words, 0, 13).double() / 2**13
    second = noise.noise_field(words, 1, 20).double() / 2**20
    correlation = torch.corrcoef(torch.stack([first, second]))[0, 1]
    assert abs(float(correlation)) < 0.02  # about 6 standard errors of independent noise


@pytest.mark.parametrize("key", [0, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, noise.rounding_key(3, 5)])
def test_update_words_are_the_product_modulo_2_to_the_32(key: int) -> None:
    """Eager words are the int32 bits of ``((index ^ key) * M) mod 2**32`` computed on
    Python ints, for int32 indices and for int64 ones past ``2**31`` (their low 32 bits)."""
    small = [0, 1, 2, 1000, 2**31 - 1]
    large = [2**31, 2**31 + 5, 2**32 - 1, 2**32 + 7]
    for indices, dtype in ((small, torch.int32), (large, torch.int64)):
        words = noise.update_words(torch.tensor(indices, dtype=dtype), key)
        expected = [((i & 0xFFFFFFFF ^ key) * noise._UPDATE_MULTIPLIER) & 0xFFFFFFFF for i in indices]
        assert words.dtype == torch.int32
        assert [w & 0xFFFFFFFF for w in words.tolist()] == expected


def _fields_compiled_and_eager(device: str, stream: int, dropped: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An update's noise fields through Inductor's generated code and eagerly, on
    ``device``, under per-row keys as the grouped step passes them."""
    index = noise.element_index((6, 300), torch.device(device))
    keys = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, noise.rounding_key(3, 5)], dtype=torch.int64)
    keys = keys.to(device)[:, None]
    field = torch.compile(lambda i, k: noise.noise_field(noise.update_words(i, k), stream, dropped), dynamic=True)
    return field(index, keys), noise.noise_field(noise.update_words(index, keys), stream, dropped)


@pytest.mark.compile
@pytest.mark.parametrize("stream, dropped", [(0, 13), (1, 20)])
def test_update_noise_fields_are_the_same_in_generated_code(stream: int, dropped: int) -> None:
    """Through Inductor's C++ (int64 words, whose loops it vectorizes) the fields equal
    the eager ones."""
    compiled, eager = _fields_compiled_and_eager("cpu", stream, dropped)
    assert torch.equal(compiled, eager)


@cuda_fp8
@pytest.mark.compile
@pytest.mark.parametrize("stream, dropped", [(0, 13), (1, 20)])
def test_update_noise_fields_are_the_same_in_triton_kernels(stream: int, dropped: int) -> None:
    """The same through the Triton kernels Inductor writes for a CUDA GPU."""
    compiled, eager = _fields_compiled_and_eager("cuda", stream, dropped)
    assert torch.equal(compiled.cpu(), eager.cpu())
