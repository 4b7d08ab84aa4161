"""The optimizer copies as torch's do: ``copy.deepcopy((model, optimizer))`` and pickling
both together give a pair that trains as the original does, bit for bit, and apart from it;
a parameter listed twice trains, updated once per step."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import amp8
from amp8.optim import LowBitAdam
from conftest import mlp

LEVELS = ["O1", "O2", "O3"]


def _build(level: str, recipe: amp8.Recipe | None = None) -> tuple[nn.Module, LowBitAdam]:
    model = mlp(32, 64, 32)
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe)


def _train(model: nn.Module, optimizer: LowBitAdam, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _deepcopy(pair: tuple[nn.Module, LowBitAdam]) -> tuple[nn.Module, LowBitAdam]:
    return copy.deepcopy(pair)


def _pickled(pair: tuple[nn.Module, LowBitAdam]) -> tuple[nn.Module, LowBitAdam]:
    buffer = io.BytesIO()
    torch.save({"model": pair[0], "opt": pair[1]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return loaded["model"], loaded["opt"]


COPIES: dict[str, Callable[[tuple[nn.Module, LowBitAdam]], tuple[nn.Module, LowBitAdam]]] = {
    "deepcopy": _deepcopy, "torch.save": _pickled,
}


def _snapshot(model: nn.Module, optimizer: LowBitAdam) -> list[torch.Tensor]:
    """Every stored tensor of the pair, as bytes where one byte wide."""
    with amp8.compact_state_dict(model):
        tensors = list(model.state_dict().values())
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return [t.detach().clone().view(torch.uint8) if t.element_size() == 1 else t.detach().clone() for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


DELAYED = amp8.Recipe(scaling="delayed", amax_history_len=4)


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["default", "delayed"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_copy_trains_as_the_original_does_and_apart_from_it(level: str, recipe: amp8.Recipe | None, how: str) -> None:
    model, optimizer = _build(level, recipe)
    _train(model, optimizer, 0, 2)
    copied, copied_opt = COPIES[how]((model, optimizer))
    assert set(copied_opt.state) == set(copied.parameters()), "the copy's state is keyed by the copied model's"
    before = _snapshot(model, optimizer)

    _train(copied, copied_opt, 2, 3)
    assert _same(_snapshot(model, optimizer), before), "stepping the copy left the original as it was"

    _train(model, optimizer, 2, 3)
    for param, other in zip(model.parameters(), copied.parameters()):
        assert torch.equal(param.detach().float(), other.detach().float())
    assert _same(_snapshot(model, optimizer), _snapshot(copied, copied_opt))
    assert copied_opt.rounding_counter == optimizer.rounding_counter
    # The copy's update groups were built again over the copied model's tensors.
    copied_params = set(copied.parameters())
    groups = copied_opt.update_groups
    assert all(member.param in copied_params for group in groups for member in group.members)
    if level != "O1":
        assert groups, "the default setup updates the FP8 weights in update groups"


@pytest.mark.parametrize("level", LEVELS)
def test_a_copy_of_a_fresh_pair_and_its_state_dict_work(level: str) -> None:
    """A pair copied before its first step trains, and its state dict loads back."""
    model, optimizer = _build(level)
    copied, copied_opt = copy.deepcopy((model, optimizer))
    _train(copied, copied_opt, 0, 2)
    _train(model, optimizer, 0, 2)
    assert _same(_snapshot(model, optimizer), _snapshot(copied, copied_opt))
    copied_opt.load_state_dict(optimizer.state_dict())
    copied_opt.zero_grad()


@pytest.mark.parametrize("level", LEVELS)
def test_a_parameter_listed_twice_trains_once_per_step(level: str) -> None:
    model = mlp(32, 64, 32)
    params = list(model.parameters())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch_optimizer = torch.optim.AdamW(params + [params[0]], lr=1e-2)
    model, optimizer = amp8.initialize(model, torch_optimizer, level)
    reference, reference_opt = _build(level)
    _train(model, optimizer, 0, 3)
    _train(reference, reference_opt, 0, 3)
    assert float(optimizer.state[model[0].weight]["step"]) == 3.0, "updated once per step"
    for param, other in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param.detach().float(), other.detach().float())
    saved = optimizer.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        again = LowBitAdam.from_optimizer(torch.optim.AdamW(params + [params[0]], lr=1e-2), optimizer.level)
    again.load_state_dict(saved)
