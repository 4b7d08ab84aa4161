import pytest
import torch

from amp8.config.levels import Precision
from amp8.optim import state as storage
from amp8.quant import noise, scaling
from amp8.quant.codec import Layout
from conftest import assert_bitwise_equal, assert_sqnr_at_least


def _words(shape: tuple[int, ...], key: int) -> torch.Tensor:
    return noise.update_words(noise.element_index(shape, torch.device("cpu")), key)


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16, Precision.FP8])
@pytest.mark.parametrize("block_size", [0, 32, 100])
@pytest.mark.parametrize("shape", [(7,), (64, 48), (3, 5, 33)])
def test_store_and_load(precision: Precision, block_size: int, shape: tuple[int, ...]) -> None:
    value = torch.randn(shape) * torch.logspace(-4, 0, shape[-1])
    state: dict = {}
    layout = storage.moment_layout("m", precision, block_size, shape)
    storage.store(state, "m", value, layout)
    assert storage.stored_precision(state, "m") is precision
    restored = storage.load(state, "m")
    assert restored.shape == value.shape and restored.dtype == torch.float32
    if precision is Precision.FP32:
        assert_bitwise_equal(restored, value)
        assert "m_scale" not in state and "m_layout" not in state
    else:
        assert_sqnr_at_least(value, restored, 25.0)
        expected_scales = () if block_size == 0 else (-(-value.numel() // block_size),)
        assert state["m_scale"].shape == expected_scales
        assert storage.layout_of(state, "m") == layout
        assert Layout.from_state(state["m_layout"]) == layout


@pytest.mark.parametrize("block_size", [0, 32])
def test_checkpoints_saved_before_layouts_load_with_their_layout_read_off_the_scales(block_size: int) -> None:
    """A state saved with ``_block_size`` (and no layout) decodes as saved, and takes
    its layout from then on."""
    value = torch.randn(64, 48)
    state: dict = {}
    layout = storage.moment_layout("exp_avg", Precision.FP8, block_size, (64, 48))
    storage.store(state, "exp_avg", value, layout)
    expected = storage.load(state, "exp_avg")
    old = {key: item for key, item in state.items() if key != "exp_avg_layout"}
    old["exp_avg_block_size"] = block_size
    assert_bitwise_equal(storage.load(old, "exp_avg"), expected)
    assert Layout.from_state(old["exp_avg_layout"]) == layout and "exp_avg_block_size" not in old


def test_blockwise_matches_a_plain_reference() -> None:
    value = torch.randn(10, 30)
    data, scales = scaling.quantize_blockwise(value, torch.float8_e4m3fn, 64)
    flat = value.flatten()
    for index, start in enumerate(range(0, flat.numel(), 64)):
        block = flat[start : start + 64]
        scale = scaling.scale_from_amax(block.abs().max(), torch.float8_e4m3fn)
        assert_bitwise_equal(scales[index], scale)
        assert_bitwise_equal(data.flatten()[start : start + 64], scaling.quantize(block, scale, torch.float8_e4m3fn))


def test_round_trip_of_stored_values_is_exact() -> None:
    state: dict = {}
    layout = storage.moment_layout("v", Precision.FP16, 128, (1000,))
    storage.store(state, "v", torch.rand(1000), layout)
    once = storage.load(state, "v")
    storage.store(state, "v", once, layout)
    assert_bitwise_equal(storage.load(state, "v"), once)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.compile)])
@pytest.mark.parametrize("vocab, dim", [(48, 16), (130, 24)])
def test_embedding_first_moment_keeps_rare_rows(fused: bool, vocab: int, dim: int) -> None:
    """The FP8 first moment of a matrix outside FP8 layers (an embedding) takes one scale
    per row: a rare token's row, 2**-40 the size of the frequent ones, keeps its 3
    mantissa bits (within one step of E4M3, which stochastic rounding may take) instead of
    rounding to zero under one scale for the table."""
    from amp8.optim import LowBitAdam

    embedding = torch.nn.Embedding(vocab, dim)
    optimizer = LowBitAdam(embedding.parameters(), level="O2", fused=fused)
    row_size = 2.0 ** -torch.linspace(0, 40, vocab).round()
    embedding.weight.grad = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0)) * row_size[:, None]
    optimizer.step()
    state = optimizer.state[embedding.weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn
    assert state["exp_avg_scale"].shape == (vocab, 1)
    expected = (1 - 0.9) * embedding.weight.grad
    restored = storage.load(state, "exp_avg")
    relative = ((restored - expected).abs() / expected.abs()).amax(dim=1)
    assert (relative <= 2.0**-3).all(), f"rows off by up to {relative.max():.3g} (worst row {relative.argmax()})"
    one_scale, _ = scaling.quantize_blockwise(expected, torch.float8_e4m3fn, 0)
    assert (one_scale.float() == 0).all(dim=1).any(), "the test's rare rows must vanish under one scale"


@pytest.mark.parametrize("tile", [None, (1, 128), (32, 32)])
def test_stochastic_first_moment_is_unbiased_where_rounding_to_nearest_shrinks_it(
    tile: tuple[int, int] | None,
) -> None:
    """Adam's first moment of noisy gradients (mean 0.2 or less, noise 1), stored in FP8
    every step: rounded to nearest it drifts towards zero (about 0.4 % below the float32
    average of the same gradients); rounded stochastically, as the optimizer stores it,
    it stays unbiased."""
    generator = torch.Generator().manual_seed(0)
    mean = (torch.rand(128, 128, generator=generator) * 2 - 1) * 0.2
    exact = torch.zeros_like(mean)
    stored: dict[str, dict] = {"nearest": {}, "stochastic": {}}
    bias = dict.fromkeys(stored, 0.0)
    layout = storage.moment_layout("exp_avg", Precision.FP8, 0, (128, 128), tile)
    for state in stored.values():
        storage.store(state, "exp_avg", exact, layout)
    for step in range(200):
        gradient = mean + torch.randn(mean.shape, generator=generator)
        exact = exact.lerp(gradient, 0.1)
        for name, state in stored.items():
            words = _words((128, 128), noise.rounding_key(0, step)) if name == "stochastic" else None
            value = storage.load(state, "exp_avg").lerp(gradient, 0.1)
            storage.store(state, "exp_avg", value, layout, words=words)
            error = (storage.load(state, "exp_avg") - exact) * exact.sign()
            bias[name] += float(error.sum() / exact.abs().sum()) / 200
    assert bias["nearest"] < -0.002, bias
    assert abs(bias["stochastic"]) < 0.001, bias


@pytest.mark.parametrize("precision", [Precision.FP16, Precision.FP32])
def test_only_an_fp8_first_moment_rounds_stochastically(precision: Precision) -> None:
    """Noise changes nothing but an FP8 first moment: the second moment and
    higher-precision first moments round to nearest, bit for bit as without noise."""
    value = torch.randn(64, 48)
    words = _words((64, 48), noise.rounding_key(1, 2))
    for key in ("exp_avg", "exp_avg_sq"):
        with_key: dict = {}
        without: dict = {}
        layout = storage.moment_layout(key, precision, 0, (64, 48))
        storage.store(with_key, key, value, layout, words=words)
        storage.store(without, key, value, layout)
        assert_bitwise_equal(storage.load(with_key, key), storage.load(without, key))
    fp8: dict = {}
    storage.store(fp8, "exp_avg_sq", value, storage.moment_layout("exp_avg_sq", Precision.FP8, 0, (64, 48)),
                  words=words)
    nearest = scaling.dequantize_blockwise(*scaling.quantize_blockwise(value, torch.float8_e4m3fn, 0), 0)
    assert_bitwise_equal(storage.load(fp8, "exp_avg_sq"), nearest)
