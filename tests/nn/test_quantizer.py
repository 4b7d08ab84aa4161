"""The per-role quantizers of ``Fp8Linear`` and the Function that gets them instead of the layer."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from amp8 import Recipe
from amp8.config.formats import E4M3, E5M2
from amp8.config.levels import Precision
from amp8.nn import CastRule, Fp8Linear, LinearQuantizers, Quantizer, TensorRole
from amp8.nn.function import _Fp8LinearFunction
from amp8.nn.gemm_config import LinearGemmConfig
from amp8.quant import scaling
from amp8.tensor.scaled import ScaledTensor
from conftest import assert_bitwise_equal

FORMATS = ["HYBRID", "E4M3"]
GRANULARITIES = ["tensorwise", "rowwise", "block"]
# (rows, columns): aligned, partial tiles under block_size=32, a single row.
SHAPES = [(64, 96), (40, 72), (1, 48)]
OVERRIDES = [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]


def _recipe(fmt: str, granularity: str, scaling_kind: str = "current", **changes: Any) -> Recipe:
    return Recipe(fp8_format=fmt, granularity=granularity, scaling=scaling_kind, block_size=32, **changes)


def _quantizers(recipe: Recipe) -> tuple[LinearQuantizers, torch.Tensor, torch.Tensor]:
    scales = torch.ones(len(TensorRole))
    histories = torch.zeros(len(TensorRole), recipe.history_len)
    return LinearQuantizers.build(recipe, scales, histories), scales, histories


def _expected_cast(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``x`` in ``dtype`` under one ``scale`` for the tensor."""
    return scaling.quantize(x, scale, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("contract_dim", [1, 0])
@pytest.mark.parametrize("role", list(TensorRole))
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_current_scaling_cast_is_quantize_tiles(fmt, granularity, role, contract_dim, shape) -> None:
    recipe = _recipe(fmt, granularity, margin=1, power_of_2_scales=granularity != "tensorwise")
    quantizer = _quantizers(recipe)[0].of(role)
    x = torch.randn(shape) * 3
    tile = recipe.tile(shape, contract_dim, weight=role is TensorRole.WEIGHT)
    dtype = E5M2 if role is TensorRole.GRAD_OUTPUT and fmt == "HYBRID" else E4M3
    data, scale = scaling.quantize_tiles(x, dtype, tile, margin=1, power_of_2=recipe.power_of_2_scales)
    cast = quantizer.cast(x, contract_dim)
    assert cast.dtype == dtype
    assert_bitwise_equal(cast.data, data)
    assert_bitwise_equal(cast.scale, scale)
    assert cast.block_size == (32 if granularity == "block" else 0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_no_scaling_casts_with_unit_scales(fmt, granularity, shape) -> None:
    quantizer = _quantizers(_recipe(fmt, granularity, "none"))[0].input
    x = torch.randn(shape) * 1000
    cast = quantizer.cast(x)
    assert torch.equal(cast.scale, torch.ones_like(cast.scale))
    assert_bitwise_equal(cast.data, scaling.quantize(x, torch.ones(()), E4M3))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("role", list(TensorRole))
@pytest.mark.parametrize("fmt", FORMATS)
def test_delayed_scaling_casts_with_the_scale_of_the_history(fmt, role, algo) -> None:
    recipe = _recipe(fmt, "tensorwise", "delayed", amax_history_len=3, amax_compute_algo=algo)
    quantizers, scales, histories = _quantizers(recipe)
    histories[role] = torch.tensor([2.0, 8.0, 0.5])
    quantizer = quantizers.of(role)
    x = torch.randn(16, 32) * 4
    history_amax = torch.tensor(8.0 if algo == "max" else 2.0)
    expected_scale = scaling.scale_from_amax(history_amax, quantizer.rule.dtype, previous=scales[role])
    cast = quantizer.cast(x, record=False)
    assert_bitwise_equal(cast.scale, expected_scale)
    assert_bitwise_equal(cast.data, _expected_cast(x, quantizer.rule.dtype, expected_scale))


@pytest.mark.parametrize("role", list(TensorRole))
def test_delayed_scaling_records_scale_and_history_in_place(role: TensorRole) -> None:
    quantizers, scales, histories = _quantizers(_recipe("HYBRID", "tensorwise", "delayed", amax_history_len=3))
    histories[role] = torch.tensor([2.0, 8.0, 0.5])
    before_scales, before_histories = scales.clone(), histories.clone()
    x = torch.full((4, 16), -5.0)
    cast = quantizers.of(role).cast(x, record=True, update_history=True)
    assert quantizers.of(role).scales is scales and quantizers.of(role).histories is histories
    assert_bitwise_equal(scales[role], cast.scale)
    assert histories[role].tolist() == [5.0, 2.0, 8.0]
    others = [r for r in TensorRole if r is not role]
    assert_bitwise_equal(scales[others], before_scales[others])
    assert_bitwise_equal(histories[others], before_histories[others])


@pytest.mark.parametrize(("record", "update_history"), [(False, False), (False, True), (True, False)])
def test_casts_that_do_not_record_leave_the_history_alone(record: bool, update_history: bool) -> None:
    quantizers, scales, histories = _quantizers(_recipe("HYBRID", "tensorwise", "delayed", amax_history_len=2))
    before_scales, before_histories = scales.clone(), histories.clone()
    cast = quantizers.input.cast(torch.randn(8, 16), record=record, update_history=update_history)
    assert_bitwise_equal(histories, before_histories)
    assert_bitwise_equal(scales[0], cast.scale if record else before_scales[0])


@pytest.mark.parametrize("scaling_kind", ["current", "delayed"])
def test_next_scale_matches_the_cast_and_changes_nothing(scaling_kind: str) -> None:
    quantizers, scales, histories = _quantizers(_recipe("E4M3", "tensorwise", scaling_kind))
    x = torch.randn(8, 16)
    scale, amax = quantizers.weight.next_scale(x)
    assert torch.equal(scales, torch.ones(3)) and torch.equal(histories, torch.zeros_like(histories))
    assert_bitwise_equal(amax, scaling.amax(x))
    assert_bitwise_equal(quantizers.weight.cast(x).scale, scale)


# Delayed scaling is tensorwise only.
SCALINGS = [("tensorwise", "delayed")] + [(g, s) for g in GRANULARITIES for s in ("current", "none")]


@pytest.mark.parametrize("shape", [(48, 64), (40, 72)])
@pytest.mark.parametrize(("granularity", "scaling_kind"), SCALINGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("grad_format", "grad_scaling"), [("E4M3", "weight"), ("gradient", "weight"), ("E5M2", "rowwise")])
def test_backward_stores_the_weight_grad_at_the_stored_weights_layout(
    fmt, granularity, scaling_kind, shape, grad_format, grad_scaling
) -> None:
    recipe = _recipe(fmt, granularity, scaling_kind, margin=2, power_of_2_scales=True).replace(
        weight_grad_format=grad_format, weight_grad_scaling=grad_scaling,
        override_linear_precision=(True, True, True),  # GEMMs of any shape; the gradient is stored in FP8
    )
    layer = Fp8Linear.from_linear(nn.Linear(shape[1], shape[0]), recipe)
    layer(torch.randn(8, shape[1])).square().sum().backward()
    grad = layer.weight.grad
    assert grad.grad_layout == layer.stored_weight.grad_layout
    assert grad.fp8.dtype == layer.stored_weight.grad_dtype
    assert grad.fp8.scale.shape == layer.stored_weight.grad_scale_shape


def test_recording_without_buffers_is_a_clear_error() -> None:
    quantizer = Quantizer(CastRule.for_role(Recipe(), TensorRole.INPUT))
    with pytest.raises(ValueError, match="record=False"):
        quantizer.cast(torch.ones(2, 16), record=True)


def test_delayed_quantizer_needs_a_history() -> None:
    with pytest.raises(ValueError, match="amax history"):
        Quantizer(CastRule.for_role(Recipe(scaling="delayed"), TensorRole.INPUT))


@pytest.mark.parametrize("override", OVERRIDES)
def test_gemm_config_names_the_overrides(override: tuple[bool, bool, bool]) -> None:
    recipe = Recipe(override_linear_precision=override)
    config = LinearGemmConfig.build(
        recipe, 32, 48, fp8_wgrad=True, update_history=False, out_dtype=torch.bfloat16
    )
    assert (config.high_fprop, config.high_dgrad, config.high_wgrad) == override
    assert (config.out_features, config.in_features) == (48, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.high_fprop = not override[0]  # type: ignore[misc]


def _modules_inside(value: Any) -> list[nn.Module]:
    """The ``nn.Module`` objects in ``value``, looking into tuples, lists and dataclasses."""
    if isinstance(value, nn.Module):
        return [value]
    if isinstance(value, (tuple, list)):
        return [module for item in value for module in _modules_inside(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _modules_inside([getattr(value, field.name) for field in dataclasses.fields(value)])
    return []


LAYER_METHODS = ["cast", "next_scale", "fp8_weight", "read_weight", "fp8_dtype", "tile", "weight_tile", "forward"]


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("storage", [Precision.FP16, Precision.FP8, Precision.AS_IS])
def test_function_gets_tensors_and_config_never_the_layer(monkeypatch, storage, granularity, override) -> None:
    recipe = Recipe(granularity=granularity, override_linear_precision=override, block_size=32)
    layer = Fp8Linear.from_linear(nn.Linear(64, 48), recipe, storage)
    applied: list[tuple[Any, ...]] = []
    original_apply = _Fp8LinearFunction.apply

    def recording_apply(*args: Any) -> torch.Tensor:
        applied.append(args)
        return original_apply(*args)

    monkeypatch.setattr(_Fp8LinearFunction, "apply", recording_apply)
    x = torch.randn(2, 20, 64, requires_grad=True)
    y = layer(x)
    (args,) = applied
    assert _modules_inside(list(args)) == [], "the autograd Function was handed a module"
    assert any(isinstance(arg, LinearQuantizers) for arg in args)
    assert any(isinstance(arg, LinearGemmConfig) for arg in args)
    def no_layer_calls(*_: Any, **__: Any) -> None:
        raise AssertionError("backward called back into the layer")

    for name in LAYER_METHODS:
        monkeypatch.setattr(layer, name, no_layer_calls)
    monkeypatch.setattr(layer.stored_weight, "quantize_grad", no_layer_calls)
    layer.weight.grad = None
    y.square().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    if storage is Precision.AS_IS:
        assert layer.weight.grad.dtype == layer.weight.dtype
    else:
        assert isinstance(layer.weight_grad, ScaledTensor)
        assert layer.weight_grad.scale.shape == layer.stored_weight.grad_scale_shape


def _assign_loaded(layer: Fp8Linear) -> Fp8Linear:
    """``layer`` with new ``scale`` and ``amax_history`` tensors assigned by loading (a
    new weight Parameter would be refused at the next forward)."""
    buffers = {"scale": layer.scale.clone(), "amax_history": layer.amax_history.clone()}
    layer.load_state_dict(buffers, strict=False, assign=True)
    return layer


REBUILDS = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda layer: pickle.loads(pickle.dumps(layer)),
    "load_state_dict(assign=True)": _assign_loaded,
    "to_empty": lambda layer: layer.to_empty(device="cpu"),
}


@pytest.mark.parametrize("rebuild", list(REBUILDS))
def test_quantizers_follow_the_layers_buffers(rebuild: str) -> None:
    original = Fp8Linear.from_linear(nn.Linear(32, 16), Recipe(scaling="delayed"))
    original_scale = original.scale
    layer = REBUILDS[rebuild](original)
    assert layer.scale is not original_scale, "the rebuild kept the buffer: nothing to check"
    for role in TensorRole:
        quantizer = layer.quantizers.of(role)
        assert quantizer.scales is layer.scale and quantizer.histories is layer.amax_history
        assert quantizer.row == role
    x = torch.full((4, 32), 3.0)
    layer.train()(x)
    assert float(layer.amax_history[TensorRole.INPUT, 0]) == 3.0
