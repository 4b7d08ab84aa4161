"""``LowBitAdam`` reads gradients through the ``GradientAverage`` attached to it, and
through nothing else: a single-process fake stands in for the data-parallel reduction."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import amp8
from amp8.optim import LowBitAdam
from amp8.optim.gradients import GradientAverage
from amp8.tensor.stored import stored_weight
from conftest import assert_bitwise_equal, mlp


class RecordingAverage:
    """A ``GradientAverage`` over one process that records each call the optimizer makes.

    ``poison`` names a parameter whose gradient ``synchronize`` makes NaN (as an average
    with an overflowing rank would); ``other_rank_nonfinite`` is what another rank says."""

    def __init__(self, poison: nn.Parameter | None = None, other_rank_nonfinite: bool = False) -> None:
        self.calls: list[Any] = []
        self.poison = poison
        self.other_rank_nonfinite = other_rank_nonfinite

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        if self.poison is None:
            return
        handle = stored_weight(self.poison)
        if handle is not None:
            handle.set_grad_from_float(torch.full(self.poison.shape, float("nan")))
        else:
            self.poison.grad.fill_(float("nan"))

    def averaged_chunk(self, param: nn.Parameter) -> torch.Tensor | None:
        self.calls.append("averaged_chunk")
        return None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.calls.append("no_sync")
        yield

    def end_round(self) -> None:
        self.calls.append("end_round")

    def reset(self) -> None:
        self.calls.append("reset")

    def any_rank(self, flag: bool) -> bool:
        self.calls.append(("any_rank", flag))
        return flag or self.other_rank_nonfinite

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        self.calls.append("max_over_ranks")
        return values


def _hand_built(level: str) -> tuple[nn.Module, LowBitAdam]:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, level, recipe=amp8.Recipe())
    return model, LowBitAdam(model.parameters(), lr=1e-2, level=level)


def _backward(model: nn.Module) -> None:
    model(torch.randn(8, 32)).pow(2).mean().backward()


def test_reduction_implements_the_protocol() -> None:
    assert issubclass(amp8.distributed.GradientReduction, GradientAverage)
    assert issubclass(RecordingAverage, GradientAverage)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_synchronizes_agrees_and_ends_the_round(level: str) -> None:
    model, optimizer = _hand_built(level)
    average = RecordingAverage()
    optimizer.attach_gradient_average(average)
    assert optimizer.gradient_average is average
    with optimizer.no_sync():
        _backward(model)
    _backward(model)
    before = model[0].read_weight()
    optimizer.step()
    optimizer.zero_grad()
    assert average.calls == ["no_sync", "synchronize", ("any_rank", False), "end_round", "reset"]
    assert optimizer.skipped_steps == 0 and not torch.equal(model[0].read_weight(), before)


@pytest.mark.parametrize("poisoned", ["fp8 weight", "bias"])
def test_the_finiteness_check_sees_the_synchronized_gradients(poisoned: str) -> None:
    model, optimizer = _hand_built("O2")
    average = RecordingAverage(poison=model[0].weight if poisoned == "fp8 weight" else model[0].bias)
    optimizer.attach_gradient_average(average)
    _backward(model)  # finite gradients: only synchronize makes one NaN
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer.step()
    assert average.calls == ["synchronize", ("any_rank", True), "end_round"]
    assert optimizer.skipped_steps == 1
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, state[name])


def test_a_non_finite_gradient_on_another_rank_skips_the_step() -> None:
    model, optimizer = _hand_built("O2")
    optimizer.attach_gradient_average(RecordingAverage(other_rank_nonfinite=True))
    _backward(model)
    before = model[0].read_weight()
    optimizer.step()
    assert optimizer.skipped_steps == 1
    assert_bitwise_equal(model[0].read_weight(), before)


def test_attached_average_changes_nothing_where_it_averages_one_rank() -> None:
    plain_model, plain = _hand_built("O2")
    model, optimizer = _hand_built("O2")
    optimizer.attach_gradient_average(RecordingAverage())
    for step in range(3):
        for m, opt in ((plain_model, plain), (model, optimizer)):
            torch.manual_seed(step)
            opt.zero_grad()
            _backward(m)
            opt.step()
    for name, value in plain_model.state_dict().items():
        assert_bitwise_equal(model.state_dict()[name], value)


def test_attaching_after_a_step_is_refused() -> None:
    model, optimizer = _hand_built("O2")
    _backward(model)
    optimizer.step()
    with pytest.raises(RuntimeError, match="before the optimizer's first step"):
        optimizer.attach_gradient_average(RecordingAverage())
    assert optimizer.gradient_average is None


def test_a_second_average_is_refused_and_the_same_one_again_does_nothing() -> None:
    _, optimizer = _hand_built("O2")
    first = RecordingAverage()
    optimizer.attach_gradient_average(first)
    optimizer.attach_gradient_average(first)
    with pytest.raises(RuntimeError, match="averaged by a RecordingAverage already"):
        optimizer.attach_gradient_average(RecordingAverage())
    assert optimizer.gradient_average is first


def test_an_object_without_the_protocol_is_refused() -> None:
    _, optimizer = _hand_built("O2")
    with pytest.raises(TypeError, match="GradientAverage"):
        optimizer.attach_gradient_average(object())  # type: ignore[arg-type]


def test_o3_refuses_an_average_over_unsharded_fp8_weights() -> None:
    """O3 in data parallel keeps each rank's rows: the weights must be sharded first."""
    _, optimizer = _hand_built("O3")
    assert not optimizer.sharded
    with pytest.raises(ValueError, match="is not sharded"):
        optimizer.attach_gradient_average(RecordingAverage())
    assert optimizer.gradient_average is None
