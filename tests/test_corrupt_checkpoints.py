"""A checkpoint with a bad scale or amax history is refused on load, naming the key, at
every level and granularity; a good one loads."""

import pytest
import torch
from torch import nn

import amp8
from amp8.optim import LowBitAdam

LEVELS = ["O1", "O2", "O3"]
RECIPES = ["tensorwise", "rowwise", "block"]
BAD_VALUES = {"zero": 0.0, "nan": float("nan"), "negative": -1.0, "inf": float("inf")}


def _trained(level: str, granularity: str, scaling: str = "current") -> tuple[nn.Module, LowBitAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    recipe = amp8.Recipe(granularity=granularity, scaling=scaling)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe)
    optimizer.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("key", ["0.weight_scale", "0.scale"])
@pytest.mark.parametrize("granularity", RECIPES)
@pytest.mark.parametrize("level", LEVELS)
def test_a_bad_layer_scale_is_refused_by_name(level: str, granularity: str, key: str, bad: str) -> None:
    model, _ = _trained(level, granularity)
    state = model.state_dict()
    model.load_state_dict(state)  # the good one loads
    state[key] = state[key].clone()
    state[key].view(-1)[0] = BAD_VALUES[bad]
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        model.load_state_dict(state)


@pytest.mark.parametrize("bad", ["nan", "negative", "inf"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_bad_amax_history_is_refused_by_name(level: str, bad: str) -> None:
    model, _ = _trained(level, "tensorwise", scaling="delayed")
    state = model.state_dict()
    state["0.amax_history"] = state["0.amax_history"].clone()
    state["0.amax_history"][0, 0] = BAD_VALUES[bad]
    with pytest.raises(ValueError, match=r"0\.amax_history"):
        model.load_state_dict(state)


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_bad_optimizer_state_scale_is_refused_by_name(level: str, bad: str) -> None:
    model, optimizer = _trained(level, "tensorwise")
    saved = optimizer.state_dict()
    fresh = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), optimizer.level)
    fresh.load_state_dict(saved)  # the good one loads
    saved["state"][0]["exp_avg_scale"] = saved["state"][0]["exp_avg_scale"].clone().fill_(BAD_VALUES[bad])
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg_scale'\]"):
        fresh.load_state_dict(saved)
