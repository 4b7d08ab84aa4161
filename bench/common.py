"""Shared pieces of amp8's benchmarks: timing, device description, JSON output."""

from __future__ import annotations

import datetime
import gc
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return the memory of dropped models to the device and restart its peak count, so
    each case starts from the same empty device and reports its own peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


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


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_alternately(first: Callable[[], Any], second: Callable[[], Any], device: torch.device, repeats: int,
                     rounds: int = 3) -> tuple[float, float]:
    """Median wall times of ``first()`` and ``second()`` in seconds, timed in turns:
    ``rounds`` times, one untimed call then ``repeats`` timed calls of ``first``, then the
    same of ``second``. Whatever else the machine does meanwhile slows both alike, so their
    ratio holds where either time alone would drift; within a turn each runs warm, with
    its own data in the caches, as it would alone."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, spent in zip((first, second), times):
            fn()
            synchronize(device)
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                synchronize(device)
                spent.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def write_result(name: str, device: torch.device, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """Write ``payload`` with the device, torch version and date to ``out_dir/name-<device>.json``,
    replacing the file whole."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        **payload,
    }
    tag = "cuda" if device.type == "cuda" else "cpu"
    path = out_dir / f"{name}-{tag}.json"
    # Written beside it, then renamed over it: a run stopped mid-write (its time limit in
    # bench/run_gpu.sh) leaves the last complete file, never half of one.
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    return path


def error_text(error: BaseException, limit: int = 500) -> str:
    """``"Type: message"`` of ``error``, cut to ``limit`` characters for the JSON."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def torchao_float8() -> tuple[Callable[..., Any] | None, str]:
    """``(convert, "available: torchao <version>")`` where torchao's float8 training
    imports, ``convert(module, recipe="tensorwise", module_filter_fn=None)`` being its
    ``convert_to_float8_training`` with the named recipe ("tensorwise" or "rowwise");
    else ``(None, "unavailable: <reason>")``."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        Float8LinearConfig.from_recipe_name("tensorwise")
    except Exception as error:  # ImportError, or a torchao built for another torch
        return None, f"unavailable: {error_text(error)}"

    def convert(module: Any, recipe: str = "tensorwise", module_filter_fn: Any = None) -> Any:
        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(module, config=config, module_filter_fn=module_filter_fn)

    return convert, f"available: torchao {getattr(torchao, '__version__', '?')}"


def graph_break_count() -> int:
    """Graph breaks torch.compile has recorded in this process since the last reset."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def reset_compiler() -> None:
    """Forget compiled code and graph-break counts, so each case compiles afresh and
    never falls back to eager on dynamo's recompilation limit."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """Time ``fn``: ``{"ms", "first_call_s"}`` (the first call includes any compilation),
    or ``{"error": "Type: message"}`` when a call raises, so one failing case does not
    end a run."""
    try:
        start = time.perf_counter()
        fn()
        synchronize(device)
        first_call_s = time.perf_counter() - start
        seconds = time_call(fn, device, warmup, repeats)
    except Exception as error:  # compile and kernel errors alike are recorded, not raised
        return {"error": error_text(error)}
    return {"ms": 1e3 * seconds, "first_call_s": first_call_s}
