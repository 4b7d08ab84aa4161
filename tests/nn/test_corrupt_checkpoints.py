"""A layer's checkpoint with a bad scale or amax history is refused on load, naming the
key, and the layer keeps what it held; a good checkpoint loads. Each key is read on its
own path: ``weight_scale`` by every ``SingleStoredWeightModule`` (the weight's scales),
``scale`` and ``amax_history`` by ``Fp8Linear`` (its casts' scales and history); at every
level, and every granularity where the scales' layout differs.

Which values the checks refuse and what their messages say: tests/quant/test_checks.py.
The optimizer's scales: tests/optim/test_optim_checkpoint.py."""

import re

import pytest
import torch
from torch import nn

import amp8
from conftest import assert_bitwise_equal, mlp

LEVELS = ["O1", "O2", "O3"]
# One bad value per key (each a different way to be bad), the first element set to it.
BAD = {"0.weight_scale": 0.0, "0.scale": float("nan"), "0.amax_history": -1.0}


def _trained(level: str, recipe: amp8.Recipe) -> nn.Module:
    model = mlp(32, 64, 16)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe)
    optimizer.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    optimizer.step()
    return model


def _assert_refused_by_name(level: str, recipe: amp8.Recipe, key: str) -> None:
    model = _trained(level, recipe)
    with amp8.compact_state_dict(model):  # the form that holds amp8's scales and histories
        state = model.state_dict()
    model.load_state_dict(state)  # the good one loads
    state[key] = state[key].clone()
    state[key].view(-1)[0] = BAD[key]
    fresh, _ = amp8.initialize(mlp(32, 64, 16, seed=1), None, level, recipe=recipe)
    before = fresh[0].read_weight()
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        fresh.load_state_dict(state)
    assert_bitwise_equal(fresh[0].read_weight(), before)


@pytest.mark.parametrize("key", ["0.weight_scale", "0.scale"])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "block"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_bad_layer_scale_is_refused_by_name(level: str, granularity: str, key: str) -> None:
    _assert_refused_by_name(level, amp8.Recipe(granularity=granularity), key)


@pytest.mark.parametrize("level", LEVELS)
def test_a_bad_amax_history_is_refused_by_name(level: str) -> None:
    _assert_refused_by_name(level, amp8.Recipe(scaling="delayed"), "0.amax_history")
