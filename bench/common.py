"""Shared pieces of amp8's benchmarks: timing, device description, JSON output."""

from __future__ import annotations

import datetime
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


def write_result(name: str, device: torch.device, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """Write ``payload`` with the device, torch version and date to ``out_dir/name-<device>.json``."""
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
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
