import pytest
import torch
from torch import nn

import amp8
from amp8 import Recipe
from amp8.config.formats import E4M3, E5M2, max_value
from amp8.config.levels import Precision
from amp8.nn import Fp8Linear, TensorRole
from amp8.quant import scaling
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal, assert_sqnr_at_least
from conftest import linear_pair as _pair

# (input shape, out_features): (B, T, C), plain (M, K), 4-D, M = 1, M not a multiple of 16.
SHAPES = [((4, 7, 32), 48), ((64, 64), 16), ((2, 3, 5, 64), 128), ((1, 32), 32), ((13, 48), 64)]
RECIPES = {
    "hybrid-current": Recipe(),
    "e4m3-current": Recipe(fp8_format="E4M3"),
    "hybrid-delayed": Recipe(scaling="delayed"),
    "hybrid-pow2": Recipe(power_of_2_scales=True),
}


def _run(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(grad_out)
    return y, x.grad


@pytest.mark.parametrize(("shape", "out_features"), SHAPES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_forward_and_gradients_against_fp32(shape, out_features, recipe_name) -> None:
    recipe = RECIPES[recipe_name]
    reference, layer = _pair(shape[-1], out_features, recipe)
    x = torch.randn(shape)
    grad_out = torch.randn(*shape[:-1], out_features)
    y_ref, gx_ref = _run(reference, x, grad_out)
    y, gx = _run(layer, x, grad_out)
    assert y.shape == y_ref.shape and gx.shape == x.shape
    assert_sqnr_at_least(y_ref, y, 18.0)
    assert_sqnr_at_least(gx_ref, gx, 17.0)
    assert_sqnr_at_least(reference.weight.grad, layer.weight_grad.dequantize(), 17.0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, atol=1e-5, rtol=1e-5)
    assert isinstance(layer.weight.grad, WeightGrad), "weight.grad must hold the FP8 weight gradient"
    assert layer.weight.grad.fp8.data is layer.weight_grad.data, "weight_grad is the data in weight.grad"
    assert layer.weight.grad.nbytes == layer.weight.numel() + layer.weight_grad.scale.nbytes


@pytest.mark.parametrize(
    ("recipe", "grad_dtype"),
    [
        (Recipe(fp8_format="HYBRID"), E4M3),
        (Recipe(fp8_format="HYBRID", weight_grad_format="gradient"), E5M2),
        (Recipe(fp8_format="E4M3", weight_grad_format="gradient"), E4M3),
        (Recipe(fp8_format="HYBRID", weight_grad_format="E4M3"), E4M3),
        (Recipe(fp8_format="E4M3", weight_grad_format="E5M2"), E5M2),
    ],
)
def test_weight_grad_is_stored_in_fp8_with_a_scale(recipe: Recipe, grad_dtype: torch.dtype) -> None:
    _, layer = _pair(32, 16, recipe)
    layer(torch.randn(8, 32)).sum().backward()
    assert layer.weight_grad.dtype == grad_dtype
    assert layer.weight_grad.shape == layer.weight.shape
    assert layer.weight_grad.scale.dtype == torch.float32 and layer.weight_grad.scale.numel() == 1
    assert layer.scale.dtype == torch.float32


def test_rowwise_weight_grad_scales_hold_one_scale_per_output_feature() -> None:
    reference, layer = _pair(32, 16, Recipe(weight_grad_format="E4M3", weight_grad_scaling="rowwise"))
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    reference(x).sum().backward()
    assert layer.weight_grad.scale.shape == (16, 1)
    assert_sqnr_at_least(reference.weight.grad, layer.weight_grad.dequantize(), 17.0)
    layer(x).sum().backward()  # accumulation re-stores the sum with the same layout
    assert layer.weight_grad.scale.shape == (16, 1)
    assert_sqnr_at_least(2 * reference.weight.grad, layer.weight_grad.dequantize(), 17.0)


def test_from_linear_reuses_the_parameters_and_stores_fp16() -> None:
    linear = nn.Linear(32, 16)
    weight, bias = linear.weight, linear.bias
    original = weight.detach().clone()
    layer = Fp8Linear.from_linear(linear, Recipe())
    assert layer.weight is weight and layer.bias is bias
    # The Parameter reports the model's dtype and reads as the weight; the storage is FP16.
    assert weight.dtype == torch.float32 and bias.dtype == torch.float32
    assert layer.weight_dtype == torch.float16 and layer.stored_weight.data.dtype == torch.float16
    scale = layer.weight_scale
    mantissa, _ = torch.frexp(scale)
    assert float(mantissa) == 0.5, "the FP16 storage scale is a power of two"
    # Scaling by a power of two commutes with rounding: storage is exactly FP16(w * s).
    stored = layer.stored_weight.data
    assert_bitwise_equal(stored, (original * scale).half())
    assert_bitwise_equal(layer.read_weight(), (original * scale).half().float() / scale)
    assert_bitwise_equal(weight.float(), layer.read_weight())
    assert float(stored.abs().max().float()) <= max_value(torch.float16) / 2


def test_the_base_with_one_stored_weight_has_its_name_and_the_old_one_says_it() -> None:
    layer = Fp8Linear.from_linear(nn.Linear(32, 16), Recipe())
    assert isinstance(layer, amp8.nn.SingleStoredWeightModule)
    with pytest.raises(ImportError, match="StoredWeightModule was removed: renamed amp8.nn.SingleStoredWeightModule"):
        exec("from amp8.nn import StoredWeightModule")


def test_fp8_weight_storage_feeds_the_gemm_directly() -> None:
    reference, _ = _pair(64, 32, Recipe())
    layer = Fp8Linear.from_linear(nn.Linear(64, 32), Recipe(), weight_storage=Precision.FP8)
    assert layer.weight_dtype == E4M3 and layer.weight.dtype == torch.float32
    fp8_weight = layer.fp8_weight()
    assert fp8_weight.data.data_ptr() == layer.stored_weight.data.data_ptr()
    with torch.no_grad():
        reference.weight.copy_(layer.read_weight())
        reference.bias.copy_(layer.bias)
    x = torch.randn(8, 64)
    assert_sqnr_at_least(reference(x), layer(x), 18.0)


def test_write_weight_round_trips_fp16_values_exactly() -> None:
    _, layer = _pair(32, 16, Recipe())
    values = layer.read_weight() * 4  # FP16-representable at a new power-of-two scale
    layer.write_weight(values)
    assert_bitwise_equal(layer.read_weight(), values)


def test_gradients_accumulate_over_backward_calls() -> None:
    reference, layer = _pair(32, 16, Recipe())
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32)
    for module in (reference, layer):
        module(x1).sum().backward()
        module(x2).sum().backward()
    assert_sqnr_at_least(reference.weight.grad, layer.weight_grad.dequantize(), 17.0)


@pytest.mark.parametrize("override_index", [0, 1, 2])
def test_each_override_runs_its_gemm_in_high_precision(override_index: int) -> None:
    override = [False, False, False]
    override[override_index] = True
    _, fp8_layer = _pair(64, 32, Recipe())
    _, mixed = _pair(64, 32, Recipe(override_linear_precision=tuple(override)))
    with torch.no_grad():
        mixed.write_weight(fp8_layer.read_weight())
        mixed.bias.copy_(fp8_layer.bias)
    weight = fp8_layer.read_weight()
    x, grad_out = torch.randn(16, 64), torch.randn(16, 32)
    y_fp8, gx_fp8 = _run(fp8_layer, x, grad_out)
    y_mix, gx_mix = _run(mixed, x, grad_out)
    exact = {
        0: (y_mix, x @ weight.t() + mixed.bias, y_fp8),
        1: (gx_mix, grad_out @ weight, gx_fp8),
        2: (
            mixed.weight_grad.dequantize(),
            scaling.dequantize(*_stored(grad_out.t() @ x, mixed)),
            fp8_layer.weight_grad.dequantize(),
        ),
    }
    got, high_precision, fp8 = exact[override_index]
    torch.testing.assert_close(got, high_precision, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, fp8), "the override changed nothing"
    for index, (out_mix, out_fp8) in enumerate([(y_mix, y_fp8), (gx_mix, gx_fp8)]):
        if index != override_index:
            assert_bitwise_equal(out_mix, out_fp8)


def _stored(grad: torch.Tensor, layer: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 storage of a float32 weight gradient (data, scale)."""
    dtype = layer.weight_grad.dtype
    scale = scaling.scale_from_amax(scaling.amax(grad), dtype)
    return scaling.quantize(grad, scale, dtype), scale


def test_delayed_scaling_uses_the_history() -> None:
    recipe = Recipe(scaling="delayed", amax_history_len=3)
    _, layer = _pair(32, 16, recipe)
    assert layer.amax_history.shape == (3, 3)
    amaxes = [2.0, 8.0, 4.0, 1.0]
    used_scales = []
    for amax in amaxes:
        x = torch.randn(4, 32)
        x = x / x.abs().max() * amax
        layer(x)
        used_scales.append(float(layer.scale[TensorRole.INPUT]))
    fp8_max = max_value(E4M3)
    # Step 1: empty history, so the tensor's own amax. Later: the max of the history.
    assert used_scales[0] == pytest.approx(fp8_max / 2.0)
    assert used_scales[1] == pytest.approx(fp8_max / 2.0)
    assert used_scales[2] == pytest.approx(fp8_max / 8.0)
    assert used_scales[3] == pytest.approx(fp8_max / 8.0)
    assert layer.amax_history[TensorRole.INPUT].tolist() == pytest.approx([1.0, 4.0, 8.0])


def test_delayed_scaling_saturates_values_beyond_the_history() -> None:
    _, layer = _pair(32, 16, Recipe(scaling="delayed"))
    layer(torch.full((4, 32), 1.0))
    x = torch.full((4, 32), 1.0)
    x[0, 0] = 100.0
    x8 = layer.cast(TensorRole.INPUT, x)
    assert float(x8.data.float().max()) == max_value(E4M3)
    assert float(x8.dequantize().max()) == pytest.approx(1.0)


@pytest.mark.parametrize(("algo", "expected_amax"), [("max", 8.0), ("most_recent", 1.0)])
def test_amax_compute_algo(algo: str, expected_amax: float) -> None:
    _, layer = _pair(32, 16, Recipe(scaling="delayed", amax_compute_algo=algo))
    for amax in (8.0, 1.0):
        layer(torch.full((4, 32), amax))
    scale, _ = layer.next_scale(TensorRole.INPUT, torch.ones(4, 32))
    assert float(scale) == pytest.approx(max_value(E4M3) / expected_amax)


def test_eval_mode_leaves_the_history_alone() -> None:
    _, layer = _pair(32, 16, Recipe(scaling="delayed"))
    layer(torch.randn(4, 32))
    history = layer.amax_history.clone()
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(4, 32) * 50)
    assert_bitwise_equal(layer.amax_history, history)


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_margin_and_power_of_2_reach_the_layer(margin: int, power_of_2: bool) -> None:
    _, layer = _pair(32, 16, Recipe(margin=margin, power_of_2_scales=power_of_2))
    x = torch.randn(4, 32)
    layer(x)
    expected = scaling.scale_from_amax(scaling.amax(x), E4M3, margin=margin, power_of_2=power_of_2)
    assert_bitwise_equal(layer.scale[TensorRole.INPUT], expected)


def test_non_finite_gradient_stays_visible_in_fp8() -> None:
    _, layer = _pair(32, 16, Recipe())
    grad_out = torch.randn(4, 16)
    grad_out[0, 0] = float("inf")
    layer(torch.randn(4, 32)).backward(grad_out)
    assert not bool(torch.isfinite(layer.weight_grad.dequantize()).all())


def test_frozen_weight_gets_no_gradient() -> None:
    _, layer = _pair(32, 16, Recipe())
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight_grad is None and x.grad is not None


def test_no_bias() -> None:
    reference, layer = _pair(32, 16, Recipe(), bias=False)
    x = torch.randn(4, 32)
    assert layer.bias is None
    assert_sqnr_at_least(reference(x), layer(x), 18.0)


def test_wrong_input_width_is_a_clear_error() -> None:
    _, layer = _pair(32, 16, Recipe())
    with pytest.raises(ValueError, match=r"inputs of shape \(\.\.\., 32\)"):
        layer(torch.randn(4, 31))


def test_bf16_inputs_give_bf16_outputs() -> None:
    reference, layer = _pair(32, 16, Recipe())
    x = torch.randn(4, 32).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert_sqnr_at_least(reference(x.float()), y.float(), 18.0)


def test_state_dict_holds_scales_and_history() -> None:
    _, layer = _pair(32, 16, Recipe(scaling="delayed", amax_history_len=4))
    layer(torch.randn(4, 32))
    with amp8.compact_state_dict(layer):
        state = layer.state_dict()
    assert set(state) == {"weight", "bias", "weight_scale", "scale", "amax_history", "gemm_precision"}
    assert state["weight"].dtype == torch.float16


def test_no_scaling_ablation_casts_plainly_and_loses_small_values() -> None:
    _, layer = _pair(32, 16, Recipe(scaling="none"))
    x = torch.randn(4, 32) * 1e-4
    x8 = layer.cast(TensorRole.INPUT, x)
    assert float(x8.scale) == 1.0
    assert_bitwise_equal(x8.data, x.to(E4M3))
    _, scaled = _pair(32, 16, Recipe())
    assert scaling.sqnr(x, x8.dequantize()) < scaling.sqnr(x, scaled.cast(TensorRole.INPUT, x).dequantize()) - 10


CACHE_RECIPES = {"tensorwise": Recipe(), "rowwise": Recipe.preset("rowwise"), "block": Recipe.preset("deepseek")}


def _accumulating_model(level: str, recipe: Recipe):
    import amp8

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("recipe_name", list(CACHE_RECIPES))
def test_cached_fp8_weight_gives_the_uncached_numerics(level: str, recipe_name: str) -> None:
    """Gradient accumulation over 3 micro-batches: casting the weight once per step gives
    the same bits as casting it for every micro-batch."""
    recipe = CACHE_RECIPES[recipe_name]
    cached, cached_optimizer = _accumulating_model(level, recipe)
    uncached, uncached_optimizer = _accumulating_model(level, recipe)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for model, optimizer in ((cached, cached_optimizer), (uncached, uncached_optimizer)):
            optimizer.zero_grad()
        for _ in range(3):
            x = torch.randn(16, 32, generator=generator)
            for module in uncached:
                if isinstance(module, Fp8Linear):
                    module.drop_weight_cache()
            y_cached, y_uncached = cached(x), uncached(x)
            assert_bitwise_equal(y_cached, y_uncached)
            y_cached.square().mean().backward()
            y_uncached.square().mean().backward()
        assert_bitwise_equal(cached[0].weight_grad.data, uncached[0].weight_grad.data)
        cached_optimizer.step()
        uncached_optimizer.step()
    for value, expected in zip(cached.state_dict().values(), uncached.state_dict().values()):
        assert_bitwise_equal(value, expected)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_weight_is_cast_once_until_it_is_written(fused: bool) -> None:
    model, optimizer = _accumulating_model("O2", Recipe())
    optimizer.fused = fused  # the compiled step stores weights its own way
    layer = model[0]
    x = torch.randn(4, 32)
    model(x).sum().backward()
    first = layer.fp8_weight()
    model(x).sum().backward()
    assert layer.fp8_weight() is first, "a second micro-batch must reuse the cached FP8 weight"
    optimizer.step()
    after_step = layer.fp8_weight()
    assert after_step is not first, "the optimizer's step writes the weight: the cache must go"
    assert not torch.equal(after_step.data.view(torch.uint8), first.data.view(torch.uint8))
    model.load_state_dict(model.state_dict())
    assert layer.fp8_weight() is not after_step, "load_state_dict must drop the cache"
    cached = layer.fp8_weight()
    model.to("cpu")
    assert layer.fp8_weight() is not cached, ".to() must drop the cache"


def test_o3_fp8_weights_are_used_as_stored_not_cached() -> None:
    model, _ = _accumulating_model("O3", Recipe())
    layer = model[0]
    assert layer.fp8_weight().data.data_ptr() == layer.stored_weight.data.data_ptr()
