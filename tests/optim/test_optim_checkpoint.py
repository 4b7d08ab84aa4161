"""Low-bit optimizer state dicts refuse to load into torch's Adam, which would misread
them, and convert exactly into what it reads; amp8's optimizer reloads its own and
refuses one with a bad scale."""

import re

import pytest
import torch
from torch import nn

import amp8
from amp8.optim import LowBitAdam, to_torch_state_dict
from amp8.optim import state as state_storage
from amp8.optim.checkpoint import MARKER_KEY
from conftest import mlp


def _trained(level: str) -> tuple[nn.Module, LowBitAdam]:
    model = mlp(32, 64, 16)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=amp8.Recipe())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def _plain_adamw() -> torch.optim.AdamW:
    model = mlp(32, 64, 16, seed=None)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_low_bit_state_is_refused_by_torch_adamw(level: str) -> None:
    _, optimizer = _trained(level)
    saved = optimizer.state_dict()
    assert any(MARKER_KEY in group for group in saved["param_groups"])
    with pytest.raises(ValueError, match="different number of parameter groups"):
        _plain_adamw().load_state_dict(saved)


def test_fp32_state_carries_no_marker_and_torch_reads_it() -> None:
    _, optimizer = _trained("O1")
    saved = optimizer.state_dict()
    assert not any(MARKER_KEY in group for group in saved["param_groups"])
    plain = _plain_adamw()
    plain.load_state_dict(saved)
    first = next(iter(plain.state.values()))
    assert first["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_amp8_reloads_its_own_state_exactly(level: str) -> None:
    model, optimizer = _trained(level)
    saved = optimizer.state_dict()
    fresh = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), optimizer.level)
    fresh.load_state_dict(saved)
    for param in optimizer.state:
        for key, value in optimizer.state[param].items():
            other = fresh.state[param][key]
            if torch.is_tensor(value):
                assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                                   other.view(torch.uint8) if other.element_size() == 1 else other), key
            else:
                assert value == other, key


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_bad_state_scale_is_refused_by_name(level: str) -> None:
    """Every scale of a low-bit moment is checked on load (which values the check refuses:
    tests/quant/test_checks.py)."""
    model, optimizer = _trained(level)
    saved = optimizer.state_dict()
    scale_keys = [key for key in saved["state"][0] if key.endswith(state_storage.SCALE_SUFFIX)]
    assert scale_keys, "a low-bit moment stores its scale"
    for key in scale_keys:
        state = {**saved["state"][0], key: torch.full_like(saved["state"][0][key], float("inf"))}
        fresh = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), optimizer.level)
        with pytest.raises(ValueError, match=re.escape(f"state[0][{key!r}]")):
            fresh.load_state_dict({**saved, "state": {**saved["state"], 0: state}})


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_converted_state_loads_into_torch_adamw_with_the_real_moments(level: str) -> None:
    _, optimizer = _trained(level)
    saved = optimizer.state_dict()
    converted = to_torch_state_dict(saved)
    plain = _plain_adamw()
    plain.load_state_dict(converted)
    params = [p for group in plain.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            expected = state_storage.load(saved["state"][index], key)
            assert torch.equal(plain.state[param][key], expected), (index, key)
        assert float(plain.state[param]["step"]) == 2.0
