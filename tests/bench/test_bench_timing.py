"""bench/timing.py: the phases of a step on the device's clock, one call, a median, calls in turns."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import load_bench

timing = load_bench("timing")


def test_phase_clock_splits_a_step_into_its_phases() -> None:
    clock = timing.PhaseClock(torch.device("cpu"))
    clock.mark()
    time.sleep(0.02)
    clock.mark()
    clock.mark()
    first, second = clock.phases_ms()
    assert first >= 20 and 0 <= second < first, (first, second)
    assert clock.marks == [], "the marks are forgotten once read"


def test_time_once_gives_the_seconds_and_the_result() -> None:
    seconds, result = timing.time_once(lambda: time.sleep(0.01) or 7, torch.device("cpu"))
    assert result == 7 and seconds >= 0.01, seconds


def test_time_call_runs_before_ahead_of_every_call_untimed() -> None:
    calls: list[str] = []

    def before() -> None:
        calls.append("before")
        time.sleep(0.02)

    seconds = timing.time_call(lambda: calls.append("call"), torch.device("cpu"), warmup=1, repeats=2, before=before)
    assert calls == ["before", "call"] * 3
    assert seconds < 0.02, f"{seconds} s: before() was timed"


def test_time_in_turns_times_each_call_in_every_round() -> None:
    calls: list[str] = []

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.01)

    fast_s, slow_s = timing.time_in_turns([lambda: calls.append("fast"), slow], torch.device("cpu"), repeats=2,
                                          rounds=2, warmup=1)
    assert calls == (["fast"] * 3 + ["slow"] * 3) * 2
    assert fast_s < 0.01 <= slow_s, (fast_s, slow_s)


def test_time_in_turns_runs_each_before_untimed_ahead_of_its_call() -> None:
    calls: list[str] = []

    def slow_before() -> None:
        calls.append("before")
        time.sleep(0.02)

    fast_s, other_s = timing.time_in_turns([lambda: calls.append("a"), lambda: calls.append("b")], torch.device("cpu"),
                                           repeats=2, rounds=1, warmup=1, befores=[slow_before, None])
    assert calls == ["before", "a"] * 3 + ["b"] * 3
    assert fast_s < 0.01 and other_s < 0.01, "a before() was timed"
    with pytest.raises(ValueError, match="one \\(or None\\) per call"):
        timing.time_in_turns([lambda: None], torch.device("cpu"), repeats=1, befores=[])
