"""The usual resume loses nothing: the model's plain ``state_dict`` and the optimizer's,
loaded into a model and optimizer built by the same ``amp8.initialize`` call, continue the
run bit for bit (the optimizer carries each FP8 layer's amax histories, GEMM precision and
weight scales, ``amp8.optim.layer_state``); a plain model state loaded with no optimizer
state after it warns, naming what is lost."""

from __future__ import annotations

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
DELAYED = amp8.Recipe(scaling="delayed", amax_history_len=4)
OUTLIER = 2.0**22


def _move_first_layer(model: nn.Module, optimizer: LowBitAdam) -> None:
    """What amp8.Controller does to a layer with token outliers in wgrad."""
    model[0].set_gemm_precision("rowwise", (False, False, False), outlier_split=True)


# name -> (recipe, set-up of the first run only, controller config or None)
SETUPS: dict[str, tuple[amp8.Recipe | None, Callable[[nn.Module, LowBitAdam], None] | None, bool]] = {
    "default": (None, None, False),
    "delayed": (DELAYED, None, False),
    "scales_not_powers_of_two": (amp8.Recipe(), None, False),
    "moved_layer": (amp8.Recipe(), _move_first_layer, False),
    "controller": (amp8.Recipe(), None, True),
}


def _build(level: str, setup: str) -> tuple[nn.Module, LowBitAdam]:
    recipe, _, with_controller = SETUPS[setup]
    controller = (
        amp8.Controller(amp8.ControllerConfig(interval=2, patience=1, max_high_precision_share=0.5))
        if with_controller else None
    )
    model = mlp(32, 64, 32)
    return amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe, controller=controller
    )


def _train(model: nn.Module, optimizer: LowBitAdam, start: int, steps: int) -> None:
    """Steps ``start .. start + steps - 1`` on batches fixed by the step index; the first
    row of each batch is a token outlier the loss ignores (what moves a controller)."""
    for step in range(start, start + steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        x[0] *= OUTLIER
        optimizer.zero_grad()
        model(x)[1:].square().mean().backward()
        optimizer.step()


def _bits(value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    return value.view(torch.uint8) if value.element_size() == 1 else value


def _assert_same_run(model: nn.Module, optimizer: LowBitAdam, other: nn.Module, other_opt: LowBitAdam) -> None:
    """Every parameter equal (torch.equal), and everything amp8 stores equal bit for bit:
    the compact model state (stored weights, scales, histories, GEMM precision) and the
    optimizer's state."""
    for (name, param), other_param in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(param.detach().float(), other_param.detach().float()), name
    with amp8.compact_state_dict(model), amp8.compact_state_dict(other):
        mine, theirs = model.state_dict(), other.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(_bits(mine[key]), _bits(theirs[key])), key
    for param, other_param in zip(model.parameters(), other.parameters()):
        state, other_state = optimizer.state[param], other_opt.state[other_param]
        assert state.keys() == other_state.keys()
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(_bits(value), _bits(other_state[key])), key
            else:
                assert value == other_state[key], key


def _saved(model: nn.Module, optimizer: LowBitAdam) -> dict:
    """Both state dicts in their default (plain) form, through torch.save and
    torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _uninterrupted(level: str, setup: str) -> tuple[nn.Module, LowBitAdam]:
    model, optimizer = _build(level, setup)
    if SETUPS[setup][1] is not None:
        SETUPS[setup][1](model, optimizer)
    _train(model, optimizer, 0, 10)
    return model, optimizer


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("level", LEVELS)
def test_plain_model_and_optimizer_state_resume_bit_for_bit(level: str, setup: str) -> None:
    model, optimizer = _build(level, setup)
    if SETUPS[setup][1] is not None:
        SETUPS[setup][1](model, optimizer)
    _train(model, optimizer, 0, 5)
    saved = _saved(model, optimizer)
    assert "weight_scale" not in " ".join(saved["model"]), "the model's state is the plain form"

    resumed, resumed_opt = _build(level, setup)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete resume warns of nothing
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
        _train(resumed, resumed_opt, 5, 5)

    _assert_same_run(*_uninterrupted(level, setup), resumed, resumed_opt)
    if setup == "moved_layer":
        assert resumed[0].gemm_description == model[0].gemm_description != resumed[2].gemm_description


@pytest.mark.parametrize("setup", ["delayed", "moved_layer"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_state_loaded_before_the_model_resumes_too(level: str, setup: str) -> None:
    """At O1/O2 the order does not matter. (At O3 the model's plain load, after the
    optimizer's, stores the FP8 weight again under scales of its own: load the model first.)"""
    model, optimizer = _build(level, setup)
    if SETUPS[setup][1] is not None:
        SETUPS[setup][1](model, optimizer)
    _train(model, optimizer, 0, 5)
    saved = _saved(model, optimizer)
    resumed, resumed_opt = _build(level, setup)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is lost, so nothing is warned of
        resumed_opt.load_state_dict(saved["optimizer"])
        resumed.load_state_dict(saved["model"])
        _train(resumed, resumed_opt, 5, 5)
    _assert_same_run(*_uninterrupted(level, setup), resumed, resumed_opt)


@pytest.mark.parametrize("level", LEVELS)
def test_a_plain_model_state_without_the_optimizers_warns_what_is_lost(level: str) -> None:
    model, optimizer = _build(level, "delayed")
    _train(model, optimizer, 0, 3)
    saved = _saved(model, optimizer)
    resumed, resumed_opt = _build(level, "delayed")
    resumed.load_state_dict(saved["model"])
    with pytest.warns(UserWarning, match="amax histories of delayed scaling.*optimizer.state_dict.*compact_state_dict"):
        _train(resumed, resumed_opt, 3, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        _train(resumed, resumed_opt, 4, 1)


def test_a_pretrained_plain_state_with_nothing_to_lose_does_not_warn() -> None:
    """Fine-tuning from plain weights under the default recipe (current scaling, power-of-two
    weight scales, no controller) loses nothing: no warning."""
    model, optimizer = _build("O2", "default")
    saved = _saved(model, optimizer)
    fresh, fresh_opt = _build("O2", "default")
    fresh.load_state_dict(saved["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(fresh, fresh_opt, 0, 1)


def test_the_layers_state_is_keyed_by_parameter_index_in_plain_types() -> None:
    model, optimizer = _build("O1", "delayed")
    _train(model, optimizer, 0, 2)
    layers = optimizer.state_dict()["amp8"]["layers"]
    assert sorted(layers) == [0, 2], "the FP8 layers' weights are parameters 0 and 2"
    entry = layers[0]
    assert torch.equal(entry["buffers"]["amax_history"], model[0].amax_history)
    assert entry["weight_scale"].shape == model[0].weight_scale.shape


@pytest.mark.parametrize("level", LEVELS)
def test_a_step_reads_the_layers_only_after_a_plain_load(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check for layer state lost to a plain load costs a step one test of a list, not
    a pass over the layers, except at the first step after such a load."""
    from amp8.optim import layer_state

    calls: list[int] = []
    real = layer_state.lost_after_plain_load
    monkeypatch.setattr(layer_state, "lost_after_plain_load", lambda *args: calls.append(1) or real(*args))
    model, optimizer = _build(level, "default")
    _train(model, optimizer, 0, 2)
    assert calls == []
    model.load_state_dict(model.state_dict())
    _train(model, optimizer, 2, 2)
    assert calls == [1]
