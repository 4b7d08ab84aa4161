"""One GPT training step (forward, backward, optimizer step): BF16 autocast against amp8 O1
and O2 and torchao's float8, each under torch.compile.

    python bench/gpt.py                                  # CUDA: the gpt-1b preset
    python bench/gpt.py --preset tiny --steps 2          # CPU smoke run, well under a minute
    python bench/gpt.py --preset gpt-125m --batch-size 16 --no-compile --out /tmp/results

Runs, in one process on the same batches and the same initial weights (amp8's byte-level
GPT from amp8/tools/experiments/gpt.py, tied head):
- baseline: torch AdamW (fused on CUDA, foreach on the CPU) under BF16 autocast on CUDA,
  in FP32 on the CPU, where there is no fast BF16 path;
- amp8 O1 and O2: ``amp8.initialize(model, AdamW, level)``, the rest of the model under the
  same autocast;
- torchao and torchao rowwise: ``convert_to_float8_training`` (tensorwise, rowwise) on the
  projections (not the tied head), torch AdamW, the same autocast, where torchao imports.
Each run compiles every transformer block with torch.compile (``--compile-scope model``:
the whole model); where that fails the error is recorded and the run falls back to eager
on a fresh model (its ``mode`` says which ran). The first ``--warmup`` steps are
untimed; the median of ``--steps`` timed steps gives step ms and tokens/s, with ratios
against the baseline, and peak memory on CUDA. On the CPU FP8 is emulated: the numbers
check the benchmark, not FP8's speed. Results go to ``--out``/gpt-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.tools.experiments.gpt import GPT, PRESETS, GPTConfig
from common import (
    RESULTS, device_name, error_text, graph_break_count, reset_compiler, synchronize, torchao_float8, write_result,
)

Batch = tuple[torch.Tensor, torch.Tensor]
RUNS = ("baseline", "amp8 O1", "amp8 O2", "torchao", "torchao rowwise")


def make_batches(config: GPTConfig, batch_size: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` batches of random bytes ``(x, y)``, each (B, T), y being x shifted by one."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return batches


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """torchao's filter: the projections amp8 also runs in FP8 (not the tied head)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0 and fqn != "head")


def build(run: str, config: GPTConfig, device: torch.device,
          to_torchao: Callable[..., Any] | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of ``run``, from the same seeded initial weights."""
    model: nn.Module = GPT(config, torch.Generator().manual_seed(0)).to(device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), **fast)
    if run.startswith("amp8"):
        model, optimizer = amp8.initialize(model, optimizer, run.split()[-1])
    elif run.startswith("torchao"):
        if to_torchao is None:
            raise RuntimeError("torchao is not available")
        recipe = "rowwise" if run.endswith("rowwise") else "tensorwise"
        model = to_torchao(model, recipe=recipe, module_filter_fn=_fp8_eligible)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, autocast: bool) -> float:
    """Forward, backward and optimizer step on ``batch``; returns the loss."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def time_steps(step: Callable[[Batch], float], batches: list[Batch], warmup: int,
               device: torch.device) -> dict[str, Any]:
    """Run ``warmup`` untimed steps (the first compiles), then time one step per remaining
    batch; returns ``{"step_ms", "first_step_s", "final_loss"}``."""
    times, loss = [], float("nan")
    first_step_s = 0.0
    for index, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        loss = step(batch)  # float() waits for the device
        elapsed = time.perf_counter() - start
        if index == 0:
            first_step_s = elapsed
        if index >= warmup:
            times.append(elapsed)
    return {"step_ms": 1e3 * statistics.median(times), "first_step_s": first_step_s, "final_loss": loss}


def compile_model(model: nn.Module, scope: str) -> nn.Module:
    """``torch.compile`` the whole model (scope "model"), or each transformer block in
    place (scope "blocks", as torchtitan does: identical blocks share one compiled
    graph, so a 20-block model compiles in about the time of one block)."""
    if scope == "model":
        return torch.compile(model)
    for block in model.blocks:
        block.compile()
    return model


def run_one(run: str, config: GPTConfig, batches: list[Batch], warmup: int, device: torch.device,
            compile: str | None, to_torchao: Callable[..., Any] | None) -> dict[str, Any]:
    """Build, compile (``compile``: "blocks", "model" or None for eager) and time one
    run; a compile error falls back to eager on a fresh model, any other error is recorded
    as ``{"error"}``."""
    result: dict[str, Any] = {}
    for mode in (["compiled", "eager"] if compile else ["eager"]):
        reset_compiler()
        _free(device)
        try:
            model, optimizer = build(run, config, device, to_torchao)
            module = compile_model(model, compile) if mode == "compiled" else model
            result.update(time_steps(lambda b: train_step(module, optimizer, b, device.type == "cuda"),
                                     batches, warmup, device))
        except Exception as error:  # recorded in the JSON, the next run goes on
            result["compile_error" if mode == "compiled" else "error"] = error_text(error)
            continue
        finally:
            model = optimizer = module = None  # free before the next run is built
        result["mode"] = f"compiled ({compile})" if mode == "compiled" else "eager"
        if mode == "compiled":
            result["graph_breaks"] = graph_break_count()
        if device.type == "cuda":
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        break
    return result


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def add_ratios(results: dict[str, dict[str, Any]], tokens_per_step: int) -> None:
    """Tokens/s of each run and its ratio to the baseline's (above 1: faster)."""
    for result in results.values():
        if "step_ms" in result:
            result["tokens_per_s"] = tokens_per_step / (result["step_ms"] / 1e3)
    base = results["baseline"].get("tokens_per_s")
    for result in results.values():
        if "tokens_per_s" in result and base:
            result["vs_baseline"] = result["tokens_per_s"] / base


def print_table(results: dict[str, dict[str, Any]], title: str) -> None:
    """The runs as a rich table."""
    table = Table(title=title)
    for column in ("run", "mode", "step ms", "tokens/s", "vs baseline", "peak GiB", "loss"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        if "step_ms" not in r:
            table.add_row(name, "skipped" if "skipped" in r else "error", "-", "-", "-", "-", "-")
            continue
        peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        table.add_row(name, r["mode"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['vs_baseline']:.2f}x" if "vs_baseline" in r else "-", peak, f"{r['final_loss']:.3f}")
    default_console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the preset defaults to gpt-1b on CUDA and tiny on the CPU."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--preset", choices=list(PRESETS), default="gpt-1b" if cuda else "tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first; the first compiles")
    parser.add_argument("--no-compile", action="store_true", help="run every model eagerly")
    parser.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                        help="torch.compile each transformer block (default) or the whole model")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    for name in ("batch_size", "steps", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is too small")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the JSON written."""
    args = parse_args(argv)
    device = torch.device(args.device)
    config = PRESETS[args.preset]
    to_torchao, torchao_status = torchao_float8()
    cuda = device.type == "cuda"
    baseline = "BF16 autocast, torch AdamW fused" if cuda else "FP32, torch AdamW foreach"
    batches = make_batches(config, args.batch_size, args.warmup + args.steps, device)
    results: dict[str, dict[str, Any]] = {}
    for run in RUNS:
        if run.startswith("torchao") and to_torchao is None:
            results[run] = {"skipped": torchao_status}
            continue
        compile = None if args.no_compile else args.compile_scope
        results[run] = run_one(run, config, batches, args.warmup, device, compile, to_torchao)
        print(f"{run} done", flush=True)
    tokens_per_step = args.batch_size * config.block_size
    add_ratios(results, tokens_per_step)
    with torch.device("meta"):  # counts without allocating
        parameters = sum(p.numel() for p in GPT(config).parameters())
    emulated = " (CPU: FP8 GEMMs are emulated, slower than FP32 by design)" if not cuda else ""
    print_table(results, f"GPT {args.preset} ({parameters / 1e6:.1f}M params) training step vs "
                         f"{baseline} on {device_name(device)}{emulated}")
    path = write_result("gpt", device, {
        "preset": args.preset, "config": dataclasses.asdict(config),
        "parameters": parameters, "batch_size": args.batch_size, "tokens_per_step": tokens_per_step,
        "warmup": args.warmup, "steps": args.steps, "compile": None if args.no_compile else args.compile_scope,
        "baseline": baseline, "fp8": "emulated on the CPU" if not cuda else "torch._scaled_mm on CUDA",
        "torchao": torchao_status, "runs": results,
    }, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
