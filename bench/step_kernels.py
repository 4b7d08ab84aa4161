"""The kernels of one GPT training step by device time: where a step's milliseconds go,
kernel by kernel, for one run of ``bench/gpt.py`` (a regression between two revisions
shows as the kernels one has and the other has not).

    python bench/step_kernels.py --device cuda --preset gpt-1b --run "amp8 O1" --top 30
    python bench/step_kernels.py --preset tiny --run "amp8 O2" --mode eager   # CPU smoke run

On CUDA it times the device's kernels (CUPTI); on the CPU, the aten operations the
profiler sees (the numbers check the script, not a GPU's kernels). Each kernel's time is
summed over ``--steps`` profiled steps after ``--warmup`` steps (the first compiles), then
divided by ``--steps``; kernels are also summed by kind (GEMM, Triton, other).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from common import reset_compiler, torchao_float8
from gpt import GPT_PRESETS, LLAMA_PRESETS, RUNS, build, compile_model, make_batches, train_step
from records import RESULTS, device_name, write_result
from timing import PhaseClock

GEMM_MARKERS = ("gemm", "cutlass", "nvjet", "sm90_", "scaled_mm", "matmul", "addmm", "::mm", "::bmm")


def kernel_kind(name: str) -> str:
    """"gemm", "triton" or "other" for a kernel's (or, on the CPU, an operation's) name."""
    lowered = f" {name.lower()}"
    if any(marker in lowered for marker in GEMM_MARKERS):
        return "gemm"
    return "triton" if "triton" in lowered else "other"


def profile_steps(run: str, mode: str, preset: str, batch_size: int, warmup: int, steps: int,
                  device: torch.device) -> list[dict[str, Any]]:
    """Each kernel of ``steps`` training steps of ``run``: name, kind, calls and
    milliseconds per step, most time first."""
    reset_compiler()
    config = GPT_PRESETS[preset] if preset in GPT_PRESETS else LLAMA_PRESETS[preset]
    batches = make_batches(config, batch_size, warmup + steps, device)
    to_torchao, _ = torchao_float8()
    model, optimizer = build(run, config, device, to_torchao)
    module = compile_model(model, "blocks") if mode == "compiled" else model
    clock = PhaseClock(device)
    autocast = device.type == "cuda"
    for batch in batches[:warmup]:
        train_step(module, optimizer, batch, autocast, clock)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        for batch in batches[warmup:]:
            train_step(module, optimizer, batch, autocast, clock)
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for event in profiler.key_averages():
        total_us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if total_us <= 0:
            continue
        rows.append({"kernel": event.key, "kind": kernel_kind(event.key), "calls_per_step": event.count / steps,
                     "ms_per_step": total_us / 1e3 / steps})
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, help="default: gpt-1b on CUDA, tiny on the CPU")
    parser.add_argument("--run", choices=RUNS, default="amp8 O1")
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--top", type=int, default=30, help="kernels printed (the JSON keeps all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Profile, print the top kernels and the totals by kind, write the JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = args.preset or ("gpt-1b" if device.type == "cuda" else "tiny")
    rows = profile_steps(args.run, args.mode, preset, args.batch_size, args.warmup, args.steps, device)
    kinds: dict[str, float] = {}
    for row in rows:
        kinds[row["kind"]] = kinds.get(row["kind"], 0.0) + row["ms_per_step"]
    print(f"{args.run}, {args.mode}, {preset}, batch {args.batch_size} on {device_name(device)}: ms per step")
    for row in rows[:args.top]:
        print(f"{row['ms_per_step']:9.3f} {row['calls_per_step']:7.1f}x {row['kind']:6s} {row['kernel'][:110]}")
    print("by kind: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in sorted(kinds.items())))
    slug = args.run.replace(" ", "-").lower()
    return write_result(f"step_kernels-{slug}-{args.mode}", device, {
        "preset": preset, "run": args.run, "mode": args.mode, "batch_size": args.batch_size,
        "warmup": args.warmup, "steps": args.steps, "ms_per_step_by_kind": kinds, "kernels": rows,
    }, args.out)


if __name__ == "__main__":
    main()
