"""How amp8's benchmarks time what they run: one call, a median over repeats, several
calls in turns, and the phases of a step on the device's own clock."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from records import error_text


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Times consecutive phases of a step on the device's own clock: ``mark()`` at each
    boundary (CUDA events on CUDA, which add no synchronization inside the step; the host
    clock elsewhere, where operations finish before they return), then ``phases_ms()``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        """Record the end of one phase and the start of the next."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def phases_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the device), and forget the marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            spans = [start.elapsed_time(end) for start, end in zip(self.marks, self.marks[1:])]
        else:
            spans = [1e3 * (end - start) for start, end in zip(self.marks, self.marks[1:])]
        self.marks = []
        return spans


def time_once(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn``, the device's work included: queued
    work is waited for first, so that only ``fn``'s is timed."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def _timed_calls(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
                 before: Callable[[], Any] | None) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn()`` in seconds, after ``warmup`` untimed ones;
    ``before()``, where given, runs untimed ahead of every call (its device work waited for)."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
            synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
              before: Callable[[], Any] | None = None) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls; ``before()``,
    where given, runs untimed ahead of every call (a barrier between processes, say)."""
    return statistics.median(_timed_calls(fn, device, warmup, repeats, before))


def time_in_turns(calls: Sequence[Callable[[], Any]], device: torch.device, repeats: int, rounds: int = 3,
                  warmup: int = 1, befores: Sequence[Callable[[], Any] | None] | None = None) -> list[float]:
    """Median wall times of each of ``calls`` in seconds, timed in turns: ``rounds`` times,
    each call in order with ``warmup`` untimed calls then ``repeats`` timed ones. Whatever
    else the machine does meanwhile slows them alike, so their ratios hold where one time
    alone would drift; within a turn each runs warm, with its own data in the caches, as
    it would alone. ``befores[i]``, where given, runs untimed ahead of every call of
    ``calls[i]`` (the backward before an optimizer step, say)."""
    befores = list(befores) if befores is not None else [None] * len(calls)
    if len(befores) != len(calls):
        raise ValueError(f"{len(befores)} befores for {len(calls)} calls; give one (or None) per call")
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for fn, before, spent in zip(calls, befores, times):
            spent.extend(_timed_calls(fn, device, warmup, repeats, before))
    return [statistics.median(spent) for spent in times]


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Time ``fn``: ``{"ms", "first_call_s"}`` (the first call includes any compilation),
    or ``{"error": "Type: message"}`` when a call raises, so one failing case does not
    end a run."""
    try:
        first_call_s, _ = time_once(fn, device)
        seconds = time_call(fn, device, warmup, repeats)
    except Exception as error:  # compile and kernel errors alike are recorded, not raised
        return {"error": error_text(error)}
    return {"ms": 1e3 * seconds, "first_call_s": first_call_s}
