"""The weight contract: an FP8 layer's weight Parameter (``amp8.tensor.ScaledWeight``)
reports the model's dtype, reads as the real weight, and re-encodes what is written into
it, while its storage stays FP16 or FP8 with its scales."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.tensor.scaled_weight import ScaledWeight
from conftest import assert_bitwise_equal, assert_sqnr_at_least, mlp

LEVELS = ["O1", "O2", "O3"]
STORAGE = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float8_e4m3fn}
PRESETS = ["tensorwise", "rowwise", "deepseek", "mxfp8"]


def _model(level: str, dtype: torch.dtype = torch.float32, preset: str = "tensorwise") -> nn.Module:
    model = mlp(64, 128, 32).to(dtype)
    return amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=amp8.Recipe.preset(preset))[0]


def _layers(model: nn.Module) -> list[Fp8Linear]:
    return [module for module in model.modules() if isinstance(module, Fp8Linear)]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_the_weight_reports_the_models_dtype_and_reads_as_the_real_weight(
    level: str, dtype: torch.dtype, preset: str
) -> None:
    model = _model(level, dtype, preset)
    for layer in _layers(model):
        weight = layer.weight
        assert isinstance(weight, ScaledWeight) and isinstance(weight, nn.Parameter)
        assert weight.dtype == dtype and weight.shape == (layer.out_features, layer.in_features)
        assert layer.stored_weight.data.dtype == STORAGE[level], "the storage stays FP16 or FP8"
        real = layer.read_weight()
        assert_bitwise_equal(weight.float(), real.to(dtype).float())
        assert_bitwise_equal(weight.detach().to(torch.float64), real.to(dtype).double())
        assert torch.equal(weight.norm(), real.to(dtype).norm())
        # Bytes as stored: the data (2 or 1 per element) and the scales, never the reported dtype's.
        handle = layer.stored_weight
        assert handle.nbytes == weight.numel() * STORAGE[level].itemsize + layer.weight_scale.nbytes
    assert next(model.parameters()).dtype == dtype


WRITES: dict[str, Callable[[nn.Parameter, torch.Tensor], None]] = {
    "copy_": lambda weight, value: weight.copy_(value),
    "data =": lambda weight, value: setattr(weight, "data", value),
    "[...] =": lambda weight, value: weight.__setitem__(slice(None), value),
    "view(-1).copy_": lambda weight, value: weight.view(-1).copy_(value.flatten()),
    "t().copy_": lambda weight, value: weight.t().copy_(value.t()),
    "data.copy_": lambda weight, value: weight.data.copy_(value),
    "mul_ then add_": lambda weight, value: weight.mul_(0).add_(value),
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("level", LEVELS)
def test_writes_store_the_new_values_and_reach_the_gemms(level: str, write: str) -> None:
    model = _model(level)
    layer = model[0]
    value = torch.randn(layer.weight.shape) * 0.05
    x = torch.randn(4, 64)
    model(x)  # a cached FP8 cast of the old weight exists at O1/O2
    with torch.no_grad():
        WRITES[write](layer.weight, value)
    data, scale = layer.stored_weight.encode(value)
    assert_bitwise_equal(layer.stored_weight.data, data)
    assert_bitwise_equal(layer.weight_scale, scale.to(layer.weight_scale.dtype))
    fresh = _model(level)
    with torch.no_grad():
        fresh[0].write_weight(value)
        fresh[2].write_weight(model[2].read_weight())
    assert_bitwise_equal(model(x), fresh(x))


@pytest.mark.parametrize("init", ["normal_", "uniform_", "zeros_", "xavier_uniform_", "trunc_normal_", "orthogonal_"])
@pytest.mark.parametrize("level", LEVELS)
def test_torch_init_functions_initialise_the_real_weight(level: str, init: str) -> None:
    """``torch.nn.init`` after ``initialize`` gives what it gives a plain weight, stored."""
    layer = _model(level)[0]
    plain = layer.read_weight()  # the same input: some inits read it (trunc_normal_'s checks)
    options = {"trunc_normal_": {"std": 0.02}}.get(init, {})  # as models call it: no sample near the bounds
    torch.manual_seed(3)
    getattr(nn.init, init)(plain, **options)
    torch.manual_seed(3)
    getattr(nn.init, init)(layer.weight, **options)
    if init == "zeros_":
        assert not layer.read_weight().any()
    else:
        assert_sqnr_at_least(plain, layer.read_weight(), {"O1": 50.0, "O2": 50.0, "O3": 20.0}[level])


@pytest.mark.parametrize("level", LEVELS)
def test_detach_and_data_share_the_storage(level: str) -> None:
    layer = _model(level)[0]
    before = layer.read_weight()
    for alias in (layer.weight.detach(), layer.weight.data):
        assert isinstance(alias, ScaledWeight) and alias.stored().data is layer.stored_weight.data
    with torch.no_grad():
        layer.weight.data.mul_(2)  # scaling by two is exact in any storage
    assert_bitwise_equal(layer.read_weight(), 2 * before)
    assert layer.weight.clone().dtype == torch.float32 and type(layer.weight.clone()) is torch.Tensor


@pytest.mark.parametrize("level", LEVELS)
def test_a_cast_to_the_weights_dtype_keeps_the_input_in_the_models_dtype(level: str) -> None:
    """T5's feed-forward casts its input to ``wo.weight.dtype`` before ``wo``."""
    model = _model(level)
    layer = model[2]
    hidden = (torch.randn(4, 128) * 1e5).requires_grad_()  # beyond FP16's range, as T5's activations are
    cast = hidden.to(layer.weight.dtype)
    assert cast.dtype == torch.float32
    out = layer(cast)
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", LEVELS)
def test_to_dtype_changes_what_the_weight_reports_and_keeps_its_storage(level: str, dtype: torch.dtype) -> None:
    model = _model(level)
    weight, handle = model[0].weight, model[0].stored_weight
    stored, real = handle.data.clone(), model[0].read_weight()
    model(torch.randn(2, 64)).sum().backward()
    model.to(dtype)
    assert model[0].weight is weight and weight.dtype == dtype
    assert_bitwise_equal(handle.data, stored)
    assert_bitwise_equal(model[0].read_weight(), real)
    assert weight.grad.dtype == dtype, "the gradient reports its Parameter's dtype"
    model.float()
    assert weight.dtype == torch.float32
    model.zero_grad()
    model(torch.randn(2, 64)).sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize("level", LEVELS)
def test_copies_and_pickles_keep_the_storage(level: str) -> None:
    model = _model(level)
    x = torch.randn(4, 64)
    copied = copy.deepcopy(model)
    # float32 scales: ``stored()`` hands them over as they are, not a copy
    assert copied[0].weight.stored().scale is copied[0].weight_scale, "a copied weight reads its copied layer's scales"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (copied, loaded):
        assert type(other[0].weight) is ScaledWeight and other[0].weight.dtype == torch.float32
        assert_bitwise_equal(other[0].stored_weight.data, model[0].stored_weight.data)
        assert_bitwise_equal(other(x), model(x))
    with torch.no_grad():
        copied[0].weight.mul_(2)
    assert not torch.equal(copied[0].read_weight(), model[0].read_weight()), "the copy is independent"


class _ReadsItsWeight(nn.Module):
    """A block that multiplies by its projection's weight directly, as Mamba and tied
    heads do, besides calling the projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x @ self.proj.weight.t())


@pytest.mark.parametrize("level", LEVELS)
def test_a_weight_read_by_model_code_trains(level: str) -> None:
    """A product with ``layer.weight`` outside the layer reads the real weight, and its
    gradient reaches the optimizer (stored in FP8 like the layer's own)."""
    torch.manual_seed(0)
    plain = _ReadsItsWeight()
    reference = copy.deepcopy(plain)
    model, optimizer = amp8.initialize(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), level)
    x = torch.randn(8, 64)
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert_sqnr_at_least(reference.proj.weight.grad, model.proj.weight.grad.float(), 15.0)
    before = model.proj.read_weight()
    optimizer.step()
    assert not torch.equal(model.proj.read_weight(), before)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("level", LEVELS)
def test_the_output_can_be_changed_in_place(level: str, bias: bool) -> None:
    """``y += residual`` on an FP8 layer's output (Falcon's MLP does it)."""
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(64, 64, bias=bias)), None, level)
    x = torch.randn(2, 16, 64, requires_grad=True)
    y = model(x)
    y += 1
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("level", LEVELS)
def test_a_chain_of_in_place_operations_runs_on_float32_values(level: str) -> None:
    """torch 2.11's ``trunc_normal_`` is ``uniform_``, ``erfinv_``, ``mul_``, ``add_``,
    ``clamp_``: each step starts from the last one's float32 values, as on a plain weight
    (rounded to FP16 or FP8 in between, a uniform sample of 1.0 would give erfinv's inf
    and a weight of 100 standard deviations)."""
    layer = _model(level)[0]
    plain = layer.read_weight()

    def chain(tensor: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            tensor.uniform_(-1, 1, generator=generator).erfinv_().mul_(0.02 * 2**0.5).add_(0.0).clamp_(-2, 2)

    chain(plain)
    chain(layer.weight)
    data, _ = layer.stored_weight.encode(plain)
    assert_bitwise_equal(layer.stored_weight.data, data)
    assert layer.weight.abs().max() < 0.2
    layer.weight.norm()  # a read: the float32 values are dropped
    assert not any(key.startswith("_amp8") for key in vars(layer.stored_weight.data))
