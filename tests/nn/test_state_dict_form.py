"""The two forms of an amp8 model's ``state_dict``: plain (the default), which loads into
the plain model class, and compact (``amp8.compact_state_dict``), which holds the weights
as stored and resumes bit for bit."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from conftest import assert_bitwise_equal, mlp

LEVELS = ["O1", "O2", "O3"]
PRESETS = ["tensorwise", "rowwise", "mxfp8"]


def _trained(level: str, dtype: torch.dtype, preset: str) -> tuple[nn.Module, nn.Module]:
    """The plain model, and an amp8 copy of it trained two steps."""
    plain = mlp(64, 128, 32).to(dtype)
    model = copy.deepcopy(plain)
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=amp8.Recipe.preset(preset)
    )
    for seed in range(2):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain, model


def _through_torch_save(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_the_plain_state_dict_loads_strictly_into_the_plain_model(level: str, dtype: torch.dtype, preset: str) -> None:
    plain, model = _trained(level, dtype, preset)
    state = model.state_dict()
    assert list(state) == list(plain.state_dict()), "the plain model's keys, none of amp8's buffers"
    assert all(type(value) is torch.Tensor and value.dtype == dtype for value in state.values())
    for route in ("torch.save", "safetensors"):
        loaded = _through_torch_save(state) if route == "torch.save" else load_safetensors(save_safetensors(state))
        target = copy.deepcopy(plain)
        target.load_state_dict(loaded)  # strict
        x = torch.randn(4, 64).to(dtype)
        assert_bitwise_equal(target(x), amp8.export(model, dtype=dtype)(x))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("level", LEVELS)
def test_the_plain_form_loads_back_into_amp8_within_one_rounding(level: str, preset: str) -> None:
    """An amp8 model stores the plain form's real values again: for a float32 model the
    same weights, up to one ulp of float32 in the scales of non-power-of-two recipes."""
    _, model = _trained(level, torch.float32, preset)
    _, other = _trained(level, torch.float32, preset)
    with torch.no_grad():
        for layer in other.modules():
            if isinstance(layer, Fp8Linear):
                layer.write_weight(torch.zeros_like(layer.read_weight()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(_through_torch_save(model.state_dict()))
    for index in (0, 2):
        torch.testing.assert_close(other[index].read_weight(), model[index].read_weight(), rtol=2**-22, atol=0)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("level", LEVELS)
def test_the_compact_form_holds_the_storage_and_restores_it_bit_for_bit(level: str, preset: str) -> None:
    plain, model = _trained(level, torch.float32, preset)
    with amp8.compact_state_dict(model):
        state = model.state_dict()
    assert model.state_dict().keys() == plain.state_dict().keys(), "the switch holds only inside the block"
    storage = torch.float8_e4m3fn if level == "O3" else torch.float16
    for index in (0, 2):
        assert state[f"{index}.weight"].dtype == storage
        assert {f"{index}.weight_scale", f"{index}.amax_history", f"{index}.gemm_precision"} <= set(state)
    # safetensors 0.8 writes E8M0 (MXFP8's stored scales) but cannot read it back.
    e8m0 = any(value.dtype == torch.float8_e8m0fnu for value in state.values())
    routes = [_through_torch_save] + ([] if e8m0 else [lambda s: load_safetensors(save_safetensors(s))])
    for route in routes:
        _, other = _trained(level, torch.float32, preset)
        other.load_state_dict(route(state))
        with amp8.compact_state_dict(other):
            for key, value in other.state_dict().items():
                assert_bitwise_equal(value, state[key])


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_bytes_of_both_forms(level: str) -> None:
    """The plain form holds each stored weight in the dtype it reports (4 bytes per
    element for a float32 model), the compact form as stored (2 or 1, and its scales)."""
    _, model = _trained(level, torch.float32, "tensorwise")
    layers = [model[0], model[2]]
    weights = sum(layer.weight.numel() for layer in layers)
    plain = model.state_dict()
    with amp8.compact_state_dict(model):
        compact = model.state_dict()
    assert sum(plain[f"{i}.weight"].nbytes for i in (0, 2)) == 4 * weights
    assert sum(compact[f"{i}.weight"].nbytes for i in (0, 2)) == weights * (1 if level == "O3" else 2)


def test_compact_state_dict_takes_a_model() -> None:
    with pytest.raises(TypeError, match="takes the model"):
        with amp8.compact_state_dict({"weight": torch.zeros(1)}):  # type: ignore[arg-type]
            pass
