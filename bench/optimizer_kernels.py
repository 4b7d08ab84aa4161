"""The kernels of one optimizer step, by name: what amp8's LowBitAdam launches and how long
each kernel runs, against torch's AdamW over the same shapes.

    python bench/optimizer_kernels.py --device cuda --millions 300     # an H100: about a minute
    python bench/optimizer_kernels.py --millions 4 --levels O2          # the CPU: operators

The layers and gradients are bench/optimizer.py's (square FP8 layers), each step after a
``zero_grad()`` and backward of its own as in training, so that FP8 gradients land in the
update groups' buffers and no copy is counted. After ``--warmup`` steps (the first
compiles), ``--steps`` steps run under ``torch.profiler``, one profile each (the backward
between them left out); each row gives, per step, the kernels (CUDA) or the operators the step calls (CPU) by
name with their calls and time, their total, and the step's wall time, so the gap
between the two is what the host or launches cost. torch's AdamW (fused on CUDA, foreach
on the CPU) over float32 layers of the same shapes is the first row. Results go to
``--out``/optimizer_kernels-<device>.json, rewritten after each row.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

import amp8
from amp8.optim import LowBitAdam
from common import free_memory, reset_compiler
from records import RESULTS, write_result
from timing import synchronize, time_once
from optimizer import LEVELS, backward_pass, square_layers


def _outermost_in_step(event: Any) -> bool:
    """Whether a profiler event is called by the optimizer step itself."""
    parent = event.cpu_parent
    return parent is not None and parent.name.startswith("Optimizer.step#")


def kernel_table(step: Callable[[], Any], device: torch.device, warmup: int, steps: int,
                 before: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run ``step`` ``warmup`` times, then ``steps`` times under the profiler: the step's
    wall ms and its kernels (or, on the CPU, top-level operators) by name, per step;
    ``before()``, where given, runs unprofiled ahead of every step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(warmup):
        if before is not None:
            before()
        step()
    wall_s, events = 0.0, []
    for _ in range(steps):
        if before is not None:
            before()
        synchronize(device)  # what ran before ends before the profile starts
        with profile(activities=activities) as prof:
            seconds, _ = time_once(step, device)
        wall_s += seconds
        events += prof.events()
    kernels: dict[str, dict[str, float]] = {}
    for event in events:
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if device.type == "cuda" and (not on_device or event.name.startswith("Optimizer.")):
            continue  # on the GPU: kernels and copies, not the step's annotated range
        if device.type != "cuda" and not _outermost_in_step(event):
            continue  # the CPU: each operator the step calls, not those nested in it
        time_us = event.device_time if on_device else event.cpu_time
        entry = kernels.setdefault(event.name, {"calls": 0.0, "us": 0.0})
        entry["calls"] += 1 / steps
        entry["us"] += time_us / steps
    ranked = dict(sorted(kernels.items(), key=lambda item: -item[1]["us"]))
    return {"step_ms": 1e3 * wall_s / steps, "kernel_ms": sum(k["us"] for k in ranked.values()) / 1e3,
            "kernel_calls": sum(k["calls"] for k in ranked.values()), "kernels": ranked}


def rows(millions: int, width: int, levels: list[str], device: torch.device, warmup: int,
         steps: int) -> Any:
    """Yield torch AdamW's row, then one per level."""
    torch.manual_seed(0)
    reference = square_layers(millions, width, device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-4, **fast)
    table = kernel_table(adamw.step, device, warmup, steps, before=backward_pass(reference, adamw, device))
    yield {"run": "torch AdamW " + next(iter(fast)), **table}
    del reference
    for level in levels:
        reset_compiler()
        free_memory(device)
        model = square_layers(millions, width, device)
        model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level,
                                           layer_selection="all")
        fused = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=True)
        yield {"run": f"amp8 {level}",
               **kernel_table(fused.step, device, warmup, steps, before=backward_pass(model, fused, device))}
        del model, optimizer, fused


def main(argv: list[str] | None = None) -> Path:
    """Profile the steps and write the JSON; its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--millions", type=int, default=4, help="millions of parameters")
    parser.add_argument("--width", type=int, default=1024, help="width of the square layers")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="kernels printed per row")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {"millions": args.millions, "width": args.width, "steps": args.steps, "rows": []}
    for row in rows(args.millions, args.width, args.levels, device, args.warmup, args.steps):
        result["rows"].append(row)
        print(f"{row['run']}: step {row['step_ms']:.2f} ms, kernels {row['kernel_ms']:.2f} ms "
              f"in {row['kernel_calls']:.0f} calls")
        for name, kernel in list(row["kernels"].items())[:args.top]:
            print(f"  {kernel['us'] / 1e3:8.3f} ms  x{kernel['calls']:<5.0f} {name[:110]}")
        path = write_result("optimizer_kernels", device, result, args.out)
    return path


if __name__ == "__main__":
    main()
