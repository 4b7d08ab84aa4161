"""Result records of amp8's benchmarks and studies: one JSON file per run, with the
device, torch version and date beside what was measured."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def error_text(error: BaseException, limit: int = 500) -> str:
    """``"Type: message"`` of ``error``, cut to ``limit`` characters for the JSON."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that ran ``bench/<script>``: with ``argv`` as its ``main`` got them,
    or the process's own arguments where ``main`` took none (run from the shell)."""
    return " ".join([f"python bench/{script}", *(sys.argv[1:] if argv is None else argv)])


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
