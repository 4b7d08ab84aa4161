import math

import pytest
import torch

from amp8.config.formats import E4M3, E5M2, max_value
from amp8.config.recipe import AmaxAlgo
from amp8.quant import noise, scaling
from conftest import assert_bitwise_equal, assert_sqnr_at_least

FP8 = [E4M3, E5M2]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("amax", [1e-6, 0.5, 3.0, 1234.5])
def test_scale_formula_is_exact(dtype: torch.dtype, amax: float) -> None:
    got = scaling.scale_from_amax(torch.tensor(amax), dtype)
    expected = torch.tensor(max_value(dtype), dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_divides_by_a_power_of_two(margin: int) -> None:
    base = scaling.scale_from_amax(torch.tensor(3.0), E4M3)
    assert_bitwise_equal(scaling.scale_from_amax(torch.tensor(3.0), E4M3, margin=margin), base / 2**margin)


@pytest.mark.parametrize("amax", [1e-6, 0.3, 3.0, 1234.5])
def test_power_of_2_scale_rounds_down(amax: float) -> None:
    exact = max_value(E4M3) / amax
    got = float(scaling.scale_from_amax(torch.tensor(amax), E4M3, power_of_2=True))
    assert got == 2.0 ** math.floor(math.log2(exact)), f"{got} is not the power of two below {exact}"


@pytest.mark.parametrize("bad_amax", [0.0, float("inf"), float("nan")])
def test_unusable_amax_keeps_previous_scale(bad_amax: float) -> None:
    previous = torch.tensor(7.5)
    got = scaling.scale_from_amax(torch.tensor(bad_amax), E4M3, previous=previous)
    assert_bitwise_equal(got, previous)
    assert float(scaling.scale_from_amax(torch.tensor(bad_amax), E4M3)) == 1.0


@pytest.mark.parametrize("power_of_2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16], ids=str)
@pytest.mark.parametrize("amax", [1e-45, 1e-40, 5e-37])
def test_scale_that_would_overflow_is_clamped(amax: float, dtype: torch.dtype, power_of_2: bool) -> None:
    overflowing = torch.tensor(max_value(dtype)) / torch.tensor(amax)
    assert torch.isinf(overflowing), f"the float32 scale {overflowing} of amax {amax} should overflow"
    got = scaling.scale_from_amax(torch.tensor(amax), dtype, power_of_2=power_of_2, previous=torch.tensor(2.0))
    assert_bitwise_equal(got, torch.tensor(scaling.MAX_SCALE))
    assert scaling.MAX_SCALE == 2.0**126


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16], ids=str)
def test_tiny_tensor_keeps_its_values(dtype: torch.dtype) -> None:
    """A tensor whose scale would overflow float32 still lands on nonzero values."""
    x = torch.tensor([[1e-38, -3e-39]])
    data, scale = scaling.quantize_tiles(x, dtype, None)
    restored = scaling.dequantize(data, scale)
    relative = float(torch.finfo(dtype).eps) / 2
    assert ((restored - x).abs() <= relative * x.abs()).all(), f"{x} came back as {restored}"


def test_smallest_float32_survives_fp16_storage() -> None:
    x = torch.tensor([2.0**-149])  # 1.4e-45, scaled by 2**126 to 2**-23, an FP16 subnormal
    data, scale = scaling.quantize_tiles(x, torch.float16, None)
    assert_bitwise_equal(scaling.dequantize(data, scale), x)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_matches_plain_reference(dtype: torch.dtype) -> None:
    x = torch.randn(64, 48) * 10
    scale = torch.tensor(3.7)
    limit = torch.finfo(dtype).max
    reference = torch.clamp(x * scale, -limit, limit).to(dtype)
    assert_bitwise_equal(scaling.quantize(x, scale, dtype), reference)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_finite_values(dtype: torch.dtype) -> None:
    x = torch.tensor([1e9, -1e9, 1.0])
    out = scaling.quantize(x, torch.tensor(1.0), dtype).float()
    limit = torch.finfo(dtype).max
    assert out.tolist() == [limit, -limit, 1.0]


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16], ids=str)
def test_quantize_saturates_finite_values_whose_product_overflows(dtype: torch.dtype) -> None:
    out = scaling.quantize(torch.tensor([1e30, -1e30]), torch.tensor(1e10), dtype).float()
    limit = torch.finfo(dtype).max
    assert out.tolist() == [limit, -limit]


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 2.0**-40, 3.7e-3, 2.0**126])
def test_saturate_is_the_clamped_product_with_non_finite_values_marked(dtype: torch.dtype, scale: float) -> None:
    """``saturate`` (fmax / fmin, then a NaN mark) gives, bit for bit, the clamped
    product with the non-finite inputs made NaN, signed zeros included."""
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -3e-39, 448.5, 1e30, -1e30, float("inf"), float("-inf"),
                      float("nan")])
    x = torch.cat([x, torch.randn(64) * torch.logspace(-30, 30, 64)])
    limit = torch.finfo(dtype).max
    product = x * torch.tensor(scale)
    expected = torch.where(x.isfinite(), product.clamp(-limit, limit), torch.nan)
    assert_bitwise_equal(scaling.saturate(x, torch.tensor(scale), dtype), expected)
    # The GPU's clipping, by fmax and fmin, marked the same way: the same bits.
    assert not scaling.clips_by_fmax(x)
    by_fmax = scaling.clip_by_fmax(product, limit).add_(x * (torch.tensor(scale) * 0.0))
    assert_bitwise_equal(by_fmax, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU clips by fmax and fmin")
@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16], ids=str)
def test_saturate_on_the_gpu_gives_the_cpus_bits(dtype: torch.dtype) -> None:
    x = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e30]), torch.randn(1000) * 100])
    scale = torch.tensor(3.7e-3)
    expected = scaling.saturate(x, scale, dtype)
    # Compiled code on a GPU clips by fmax and fmin; eager code by clamp_, one kernel.
    compiled = torch.compile(scaling.saturate, fullgraph=True, dynamic=True)
    assert_bitwise_equal(compiled(x.cuda(), scale.cuda(), dtype).cpu(), expected)
    assert not scaling.clips_by_fmax(x.cuda())
    assert_bitwise_equal(scaling.saturate(x.cuda(), scale.cuda(), dtype).cpu(), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_scale_gives_nan(bad: float) -> None:
    out = scaling.quantize(torch.tensor([0.0, -2.0, 3.0]), torch.tensor(bad), E4M3).float()
    assert out.isnan().all(), out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_quantize_stochastic_turns_non_finite_into_nan(dtype: torch.dtype, bad: float) -> None:
    out = scaling.quantize_stochastic(torch.tensor([bad, 1e30, 2.0**-40]), torch.tensor(2.0**40), dtype, 7).float()
    limit = torch.finfo(dtype).max
    assert math.isnan(out[0]), f"{bad} became {out[0]} in {dtype}"
    assert out[1:].tolist() == [limit, 1.0]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_quantize_keeps_non_finite_visible(dtype: torch.dtype, bad: float) -> None:
    out = scaling.quantize(torch.tensor([bad, 1.0]), torch.tensor(1.0), dtype).float()
    assert not torch.isfinite(out[0]), f"{bad} became {out[0]} in {dtype}"
    assert out[1] == 1.0


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [0.37, 1.0, 1024.0, 3e5])
def test_round_trip_of_fp8_values_is_exact(dtype: torch.dtype, scale: float) -> None:
    """Every finite FP8 value dequantizes and quantizes back to the same bits."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[torch.isfinite(codes.float())]
    scale_t = torch.tensor(scale)
    again = scaling.quantize(scaling.dequantize(codes, scale_t), scale_t, dtype)
    assert_bitwise_equal(again, codes)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", [(1024,), (64, 256), (8, 16, 32)])
def test_quantize_dequantize_sqnr(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    scale = scaling.scale_from_amax(scaling.amax(x), dtype)
    restored = scaling.dequantize(scaling.quantize(x, scale, dtype), scale)
    assert_sqnr_at_least(x, restored, 25.0)


@pytest.mark.parametrize(("algo", "expected"), [(AmaxAlgo.MAX, 9.0), (AmaxAlgo.MOST_RECENT, 2.0)])
def test_history_amax(algo: AmaxAlgo, expected: float) -> None:
    history = torch.tensor([2.0, 9.0, 4.0])
    assert float(scaling.history_amax(history, algo)) == expected


def test_push_history_drops_the_oldest() -> None:
    history = torch.tensor([[3.0, 2.0, 1.0], [6.0, 5.0, 4.0]])
    pushed = scaling.push_history(history, torch.tensor([9.0, 8.0]))
    assert pushed.tolist() == [[9.0, 3.0, 2.0], [8.0, 6.0, 5.0]]
    assert scaling.push_history(history[0], torch.tensor(7.0)).tolist() == [7.0, 3.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_all_finite_reads_fp8_bytes_as_their_values_say(dtype: torch.dtype) -> None:
    """Every one of the 256 FP8 bytes, alone among finite ones: finite exactly where its
    float32 value is."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    for byte in range(256):
        tensor = torch.zeros(5, dtype=dtype)
        tensor[2] = every[byte]
        assert bool(scaling.all_finite([tensor])) == bool(torch.isfinite(every[byte].float())), byte
    transposed = torch.zeros(4, 3, dtype=dtype).t()  # a strided view reads its own elements
    transposed[1, 2] = every[255]
    assert not bool(scaling.all_finite([torch.ones(2), transposed]))


def test_all_finite() -> None:
    assert bool(scaling.all_finite([torch.ones(3), torch.zeros(2, dtype=E4M3)]))
    assert not bool(scaling.all_finite([torch.ones(3), torch.tensor([float("nan")])]))
    assert bool(scaling.all_finite([]))
    assert bool(scaling.all_finite([torch.empty(0), torch.full((4,), 3e38)]))
    assert not bool(scaling.all_finite([torch.tensor([1.0, float("-inf")])]))
    assert not bool(scaling.all_finite([torch.tensor([1.0, float("inf")]).to(E5M2)]))
    assert not bool(scaling.all_finite([torch.tensor([float("nan"), 2.0]).to(E4M3)]))


def test_sqnr_of_known_noise() -> None:
    reference = torch.ones(100)
    assert scaling.sqnr(reference, reference * 1.1) == pytest.approx(20.0)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [*FP8, torch.float16], ids=str)
def test_compiled_quantize_keeps_non_finite_visible_as_eager(dtype: torch.dtype) -> None:
    """The compiled cast marks inf and NaN as eager does (no simplification of x * 0)."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -3.0, 0.0, 2.0**-30] * 3)
    scale = torch.tensor(2.0**8)
    compiled = torch.compile(scaling.quantize, fullgraph=True, dynamic=False)
    eager, graph = scaling.quantize(x, scale, dtype), compiled(x, scale, dtype)
    assert torch.equal(eager.view(torch.uint8) if eager.element_size() == 1 else eager.view(torch.int16),
                       graph.view(torch.uint8) if graph.element_size() == 1 else graph.view(torch.int16))
    assert torch.isnan(eager.float()[:3]).all()


@pytest.mark.parametrize("tile", [None, (1, 48), (16, 16), (1, 32)])
@pytest.mark.parametrize("stack", [(3,), (2, 2)])
def test_a_stack_of_matrices_takes_each_matrixs_own_tiles(tile, stack) -> None:
    """``tile_amax`` and ``quantize_tiles`` of a stack of experts' matrices give each
    matrix what it gets alone, bit for bit; one scale per tensor becomes one per matrix
    (``matrix_tile``), and a plain matrix keeps its tile."""
    x = torch.randn(*stack, 40, 48)
    x[0] *= 1000.0  # one expert's values must not move another's scales
    per_matrix = scaling.matrix_tile(tile, tuple(x.shape))
    assert scaling.matrix_tile(tile, (40, 48)) == tile
    data, scale = scaling.quantize_tiles(x, E4M3, per_matrix, power_of_2=True)
    flat_x, flat_data, flat_scale = x.reshape(-1, 40, 48), data.reshape(-1, 40, 48), scale.flatten(0, len(stack) - 1)
    for matrix, stored, scales in zip(flat_x, flat_data, flat_scale):
        alone_data, alone_scale = scaling.quantize_tiles(matrix, E4M3, per_matrix, power_of_2=True)
        assert_bitwise_equal(stored, alone_data)
        assert_bitwise_equal(scales, alone_scale)


def _every_noise(dtype: torch.dtype) -> torch.Tensor:
    """Every signed noise value ``quantize_with_noise`` takes for ``dtype``, in order."""
    half = 1 << (scaling.dropped_bits(dtype) - 1)
    return torch.arange(-half, half, dtype=torch.int32)


# Values between neighbours, on a neighbour, at the bottom of a binade, zero; with those
# below the format's smallest normal (a subnormal result) and its largest finite value.
_VALUES = [1.0 + 2.0**-12, -3.3, 2.0**-3 * (1 + 2.0**-21), 1.0, -0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, E4M3, E5M2], ids=str)
@pytest.mark.parametrize("value", [*_VALUES, "tiny/3", "-tiny*0.7", "max"])
def test_stochastic_rounding_is_exactly_unbiased_over_all_noise(dtype: torch.dtype, value: float | str) -> None:
    """Over every noise value, the results average to the value exactly (float64 sums of
    dtype values are exact here), each one of the value's two neighbours. Below dtype's
    smallest normal the value is first moved up by it in float32, which rounds away its
    bits below float32's spacing there: the average is that moved value's, moved back."""
    info = torch.finfo(dtype)
    x = {"tiny/3": info.tiny / 3, "-tiny*0.7": -info.tiny * 0.7, "max": info.max}.get(value, value)
    x = torch.tensor(x, dtype=torch.float32)
    every = _every_noise(dtype)
    rounded = scaling.quantize_with_noise(x.expand(every.numel()).clone(), torch.ones(()), dtype, every.clone())
    results = rounded.double()
    offset = torch.tensor(info.tiny if abs(float(x)) < info.tiny else 0.0).copysign(x)
    assert float(results.sum()) == float(((x + offset) - offset).double()) * every.numel()
    assert len(set(results.unique().tolist())) <= 2
    down, up = float(results.min()), float(results.max())
    assert down <= float(x) <= up


@pytest.mark.parametrize("dtype", [torch.float16, E4M3], ids=str)
def test_the_second_noise_field_rounds_unbiased_to_its_stated_bound(dtype: torch.dtype) -> None:
    """The first moment's field (stream 1) from every value of the word bits it reads:
    the mean result is within ``2**-19`` of a unit of the value (exact for FP16, whose
    13 bits the field fills)."""
    dropped = scaling.dropped_bits(dtype)
    words = torch.arange(1 << 19, dtype=torch.int32) * 97 + (1 << 30)  # any bits above 18
    field = noise.noise_field(words, 1, dropped)
    unit = 2.0 ** (dropped - 23)  # of values in [1, 2)
    for fraction in (0.0, 1 / 3, 0.5, 0.999):
        x = torch.tensor(1.0 + fraction * unit, dtype=torch.float32)
        rounded = scaling.quantize_with_noise(x.expand(field.numel()).clone(), torch.ones(()), dtype, field)
        bound = 0.0 if dropped <= 19 else 2.0**-19 * unit
        assert abs(float(rounded.double().mean()) - float(x)) <= bound, fraction
