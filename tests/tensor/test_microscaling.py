"""MXFP8 and NVFP4 quantize/dequantize, E8M0 scales and FP4 packing (amp8.tensor.block_scaled)."""

import pytest
import torch

from amp8.config import formats
from amp8.config.formats import E4M3, E5M2, E8M0, FP4_MAX
from amp8.quant import noise, scaling
from amp8.tensor import block_scaled as microscaling
from conftest import assert_bitwise_equal, assert_sqnr_at_least

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
SHAPES = [(32, 64), (48, 96), (130, 32)]


def _nearest_even_reference(values: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding by brute force in float64: the nearest grid value, the even code on
    a tie, the sign kept, magnitudes beyond 6 saturated."""
    magnitude = values.double().abs().clamp(max=FP4_MAX)
    distance = (magnitude[:, None] - E2M1_VALUES).abs()
    nearest = distance.min(1, keepdim=True).values
    candidates = distance == nearest  # one or two codes
    codes = torch.arange(8)
    # on a tie prefer the even code: rank codes by (is odd, code)
    rank = torch.where(candidates, (codes % 2) * 8 + codes, 100)
    return E2M1_VALUES[rank.argmin(1)].copysign(values.double())


def test_fp4_rounds_to_nearest_with_ties_to_the_even_code() -> None:
    grid = E2M1_VALUES.float()
    midpoints = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, midpoints, midpoints + 1e-3, midpoints - 1e-3, torch.tensor([7.0, 1e9]),
                        torch.randn(1000) * 3])
    values = torch.cat([values, -values])
    got = microscaling.decode_fp4(microscaling.encode_fp4(values)).double()
    torch.testing.assert_close(got, _nearest_even_reference(values), atol=0, rtol=0)


@pytest.mark.parametrize("key", [0, 7, 2**31 + 5])
def test_fp4_stochastic_rounding_goes_up_exactly_where_the_noise_is_below_the_fraction(key) -> None:
    """Element by element against a reference from the grid itself: the neighbours below
    and above a magnitude, and the counter-based noise the key gives."""
    grid = E2M1_VALUES.float()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.rand(4000) * 6, torch.tensor([6.5, 1e9])])
    values = torch.cat([values, -values])
    magnitude = values.abs().clamp(max=6.0)
    below = grid[torch.searchsorted(grid, magnitude, right=True) - 1]
    above = grid[torch.searchsorted(grid, magnitude, right=False).clamp(max=7)]
    fraction = torch.where(above > below, (magnitude - below) / (above - below).clamp(min=0.5), 0.0)
    up = noise.uniform(values.shape, key, values.device) < fraction
    expected = torch.where(up, above, below).copysign(values)
    got = microscaling.decode_fp4(microscaling.encode_fp4(values, key))
    torch.testing.assert_close(got.abs(), expected.abs(), atol=0, rtol=0)
    assert bool(((got == 0) | (got.sign() == values.sign())).all())


def test_every_fp4_code_decodes_to_the_e2m1_value() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.cat([E2M1_VALUES, -E2M1_VALUES]).float()
    assert_bitwise_equal(microscaling.decode_fp4(codes), expected)
    assert_bitwise_equal(microscaling.encode_fp4(expected), torch.where(expected == 0, codes % 8, codes))


@pytest.mark.parametrize("shape", [(4, 6), (32, 64), (7, 16)])
@pytest.mark.parametrize("dim", [0, 1])
def test_fp4_pack_unpack_round_trips(shape, dim) -> None:
    sizes = list(shape)
    sizes[dim] *= 2
    codes = torch.randint(0, 16, sizes, dtype=torch.uint8)
    packed = microscaling.pack_fp4(codes, dim)
    assert packed.shape[dim] == sizes[dim] // 2 and packed.dtype == torch.uint8
    assert_bitwise_equal(microscaling.unpack_fp4(packed, dim), codes)
    # viewed as torch's packed dtype, the same bytes unpack alike; the low nibble is the even element
    assert_bitwise_equal(microscaling.unpack_fp4(packed.view(formats.FP4), dim), codes)
    first = codes.select(dim, 0) | (codes.select(dim, 1) << 4)
    assert_bitwise_equal(packed.select(dim, 0), first)


def test_odd_length_cannot_pack() -> None:
    with pytest.raises(ValueError, match="odd"):
        microscaling.pack_fp4(torch.zeros(3, 5, dtype=torch.uint8), 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("tile", [(1, 32), (32, 1)])
def test_mxfp8_scales_are_e8m0_powers_of_two_and_round_trip_exactly(shape, dtype, tile) -> None:
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[1])  # columns of very different range
    cast = microscaling.quantize_mx(x, dtype, tile)
    assert cast.scales.dtype == E8M0 and cast.data.dtype == dtype
    assert cast.scales.shape == (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))
    # the same elements as amp8's block cast with power-of-two scales, decode = 1 / scale exactly
    data, storage = scaling.quantize_tiles(x, dtype, tile, power_of_2=True)
    assert_bitwise_equal(cast.data, data)
    assert_bitwise_equal(cast.decode_scales(), storage.reciprocal())
    real = cast.dequantize()
    assert_bitwise_equal(real, data.float() * scaling.expand_scale(storage.reciprocal(), shape, 32))
    # re-quantizing MX values changes no value (a block whose amax rounded down to a
    # power of two may take the next scale, its elements a binade lower)
    assert_bitwise_equal(microscaling.quantize_mx(real, dtype, tile).dequantize(), real)
    assert_sqnr_at_least(x, real, 25.0 if dtype == E4M3 else 20.0)


def test_mxfp8_zero_block_gets_scale_one() -> None:
    x = torch.randn(2, 64)
    x[0, :32] = 0
    cast = microscaling.quantize_mx(x, E4M3, (1, 32))
    assert float(cast.scales[0, 0].float()) == 1.0
    assert_bitwise_equal(cast.dequantize()[0, :32], torch.zeros(32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", [(1, 16), (16, 1), (16, 16)])
def test_nvfp4_decodes_exactly_and_holds_its_sqnr(shape, tile) -> None:
    x = torch.randn(shape)
    cast = microscaling.quantize_nvfp4(x, tile)
    assert cast.dtype == formats.FP4 and cast.scales.dtype == E4M3
    packed_dim = 0 if tile[0] > tile[1] else 1
    assert cast.packed_dim == packed_dim and cast.data.shape[packed_dim] == shape[packed_dim] // 2
    tensor_scale = float(cast.tensor_scale)
    assert tensor_scale == 2.0 ** round(torch.log2(torch.tensor(tensor_scale)).item()), "a power of two"
    # decode in float64: element * E4M3 block scale * tensor scale
    codes = microscaling.unpack_fp4(cast.data, packed_dim)
    elements = microscaling.decode_fp4(codes).double()
    blocks = cast.scales.double().repeat_interleave(tile[0], 0)[: shape[0]].repeat_interleave(tile[1], 1)[:, : shape[1]]
    torch.testing.assert_close(cast.dequantize().double(), elements * blocks * tensor_scale, atol=0, rtol=0)
    # the largest block scale lands in E4M3's top binade: the tensor scale wastes no range
    assert 224 <= float(cast.scales.float().max()) <= 448
    # measured 19.1-20.5 dB on Gaussian inputs (E2M1 has one mantissa bit)
    assert_sqnr_at_least(x, cast.dequantize(), 18.0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_values_stay_visible(bad) -> None:
    x = torch.randn(4, 64)
    x[1, 3] = bad
    nvfp4 = microscaling.quantize_nvfp4(x, (1, 16)).dequantize()
    mx = microscaling.quantize_mx(x, E4M3, (1, 32)).dequantize()
    assert bool(nvfp4[1, :16].isnan().all()) and bool(nvfp4[~torch.isnan(nvfp4)].isfinite().all())
    assert bool(mx[1, 3].isnan()) and int(nvfp4.isnan().sum()) == 16
    assert_sqnr_at_least(x[[0, 2, 3]], nvfp4[[0, 2, 3]], 18.0)


def test_nvfp4_stochastic_rounding_is_unbiased_and_keyed() -> None:
    # each row: one element that sets the block scale (6 units) and fifteen at 0.35 units,
    # between the grid values 0 and 0.5: nearest rounding moves them all to 0.5
    x = torch.full((256, 16), 0.35)
    x[:, 0] = 6.0
    nearest = microscaling.quantize_nvfp4(x, (1, 16)).dequantize()[:, 1:]
    stochastic = microscaling.quantize_nvfp4(x, (1, 16), noise_key=7).dequantize()[:, 1:]
    assert abs(float(nearest.mean()) - 0.5) < 1e-6
    assert abs(float(stochastic.mean()) - 0.35) < 0.01, f"biased: mean {float(stochastic.mean())}"
    assert set(stochastic.unique().tolist()) == {0.0, 0.5}
    again = microscaling.quantize_nvfp4(x, (1, 16), noise_key=7)
    other = microscaling.quantize_nvfp4(x, (1, 16), noise_key=8)
    assert_bitwise_equal(again.dequantize()[:, 1:], stochastic)
    assert not torch.equal(other.dequantize()[:, 1:], stochastic)


def test_data_noise_key_follows_the_tensor() -> None:
    g = torch.randn(8, 16)
    assert int(microscaling.data_noise_key(g)) == int(microscaling.data_noise_key(g.clone()))
    assert int(microscaling.data_noise_key(g)) != int(microscaling.data_noise_key(g * 1.5))
    assert 0 <= int(microscaling.data_noise_key(g)) < 2**32


def test_transpose_and_repack_keep_the_values() -> None:
    x = torch.randn(32, 48)
    cast = microscaling.quantize_nvfp4(x, (16, 16))
    real = cast.dequantize()
    assert_bitwise_equal(cast.t().dequantize(), real.t())
    repacked = cast.packed_along(0)
    assert repacked.packed_dim == 0 and repacked.data.shape == (16, 48)
    assert_bitwise_equal(repacked.dequantize(), real)
    mx = microscaling.quantize_mx(x, E4M3, (1, 32))
    assert_bitwise_equal(mx.t().dequantize(), mx.dequantize().t())
