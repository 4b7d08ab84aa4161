"""One GPT training step (forward, backward, optimizer step): BF16 autocast against
torchao's float8 and amp8 O1, O2 and O3, each compiled and eager, the optimizer's share
timed apart.

    python bench/gpt.py                                  # CUDA: the gpt-1b preset
    python bench/gpt.py --preset tiny --steps 2 --modes eager   # CPU smoke run, seconds
    python bench/gpt.py --preset llama3-8b-layers --batch-size 1 --modes compiled
    python bench/gpt.py --preset gpt-125m --modes eager --runs baseline "amp8 O2" --out /tmp/results

Runs, in one process on the same batches and the same initial weights:
- baseline: torch AdamW (fused on CUDA, foreach on the CPU) under BF16 autocast on CUDA,
  in FP32 on the CPU, where there is no fast BF16 path;
- torchao and torchao rowwise: ``convert_to_float8_training`` (tensorwise, rowwise) on the
  projections (not the head), torch AdamW, the same autocast, where torchao imports;
- amp8 O1, O2 and O3: ``amp8.initialize(model, AdamW, level)``, the rest of the model
  under the same autocast; amp8's ``LowBitAdam`` takes its default step, fused (compiled
  per tensor) on CUDA.
Each run goes once per mode (``--modes``): "compiled" compiles every transformer block
with torch.compile (``--compile-scope model``: the whole model), "eager" runs the model as
it is; every compiled row comes first, and the JSON is rewritten after each row, so a run
cut short keeps what it measured. The first ``--warmup`` steps are untimed (the first
compiles); of the ``--steps`` timed steps the median gives step ms (wall clock, from the
host) and tokens/s, and, timed apart on the device's clock (CUDA events), forward+backward
ms and optimizer ms; ratios are against the baseline of the same mode, with peak memory on
CUDA. The models are amp8's byte-level GPT (amp8/tools/experiments/gpt.py, tied head:
presets tiny to gpt-1b) and the experiments' byte-level Llama (transformers'
LlamaForCausalLM, amp8/tools/experiments/llama.py; needs transformers): llama3-8b-layers
has four of Llama-3-8B's layers (width 4096, MLP 14336, 32 query and 8 key/value heads)
at the context torchtitan trains it with, to set beside torchao's published speed-up on
Llama-3-8B, and llama-tiny the same layout at test size. Their vocabulary is bytes: a
128256-entry head would be over a third of four layers' GEMM work (7 % of the real 32
layers') and hide the layers' speed-up. On the CPU FP8 is emulated: the numbers check the
benchmark, not FP8's speed. Results go to ``--out``/gpt-<device>.json for the byte GPT's
presets, gpt-<preset>-<device>.json for the others.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Callable, Union
from unittest import mock

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.tensor import weight_grad
from amp8.tools.experiments.gpt import PRESETS as GPT_PRESETS
from amp8.tools.experiments.gpt import GPTConfig
from amp8.tools.experiments.llama import LlamaSpec
from common import free_memory, graph_break_count, reset_compiler, torchao_float8
from records import RESULTS, device_name, error_text, write_result
from timing import PhaseClock, time_once

Batch = tuple[torch.Tensor, torch.Tensor]
Config = Union[GPTConfig, LlamaSpec]
RUNS = ("baseline", "torchao", "torchao rowwise", "amp8 O1", "amp8 O2", "amp8 O3",
        "amp8 O2 compiled slots", "amp8 O1 compiled casts", "amp8 O2 compiled casts")
"""The "compiled casts" runs are amp8 with ``compiled_casts=True``: eager, they run the FP8
casts as amp8's compiled kernels; compiled, they are the run without it, so skipped.
"amp8 O2 compiled slots" is amp8 O2 with every FP8 weight gradient of 2048 x 2048 elements or
more written by the compiled backward into the optimizer's buffer through amp8's operator
(``amp8.tensor.weight_grad.COMPILED_SLOT_MIN_ELEMENTS`` set to that size), where amp8 O2
quantizes it inside the graph and copies it in at the step; eager it is amp8 O2, so
skipped."""
MODES = ("compiled", "eager")
LLAMA_PRESETS = {
    "llama3-8b-layers": LlamaSpec(n_layer=4, n_head=32, n_kv_head=8, n_embd=4096, intermediate=14336,
                                  block_size=8192),  # 0.87e9 parameters
    "llama-tiny": LlamaSpec(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=224, block_size=64),
}
PRESETS: dict[str, Config] = {**GPT_PRESETS, **LLAMA_PRESETS}


def make_batches(config: Config, batch_size: int, count: int, device: torch.device) -> list[Batch]:
    """``count`` batches of random bytes ``(x, y)``, each (B, T), y being x shifted by one."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return batches


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """torchao's filter: the projections amp8 also runs in FP8 (not the head: the GPT's
    ``head``, the Llama's ``lm.lm_head``)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0 and not fqn.endswith("head"))


def new_model(config: Config, device: torch.device) -> nn.Module:
    """The model of ``config`` with its seeded initial weights, drawn on ``device`` (a
    billion weights drawn on the host take longer than a compile): the GPT draws them
    from a generator there, transformers' Llama under a seed it takes from a host one."""
    generator = torch.Generator(device if isinstance(config, GPTConfig) else "cpu").manual_seed(0)
    with torch.device(device):
        return config.build(generator)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's transformer blocks: the GPT's ``blocks``, the Llama's decoder layers."""
    return model.lm.model.layers if hasattr(model, "lm") else model.blocks


def build(run: str, config: Config, device: torch.device,
          to_torchao: Callable[..., Any] | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of ``run``, from the same seeded initial weights."""
    model = new_model(config, device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), **fast)
    if run.startswith("amp8"):
        model, optimizer = amp8.initialize(model, optimizer, run.split()[1],
                                           compiled_casts=run.endswith("compiled casts"))
    elif run.startswith("torchao"):
        if to_torchao is None:
            raise RuntimeError("torchao is not available")
        recipe = "rowwise" if run.endswith("rowwise") else "tensorwise"
        model = to_torchao(model, recipe=recipe, module_filter_fn=_fp8_eligible)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, autocast: bool,
               clock: PhaseClock) -> float:
    """Forward, backward and optimizer step on ``batch``, marking ``clock`` at the start,
    after the backward pass and at the end; returns the loss."""
    x, y = batch
    clock.mark()
    optimizer.zero_grad(set_to_none=True)
    context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        _, loss = model(x, y)
    loss.backward()
    clock.mark()
    optimizer.step()
    clock.mark()
    return float(loss.detach())


def time_steps(step: Callable[[Batch, PhaseClock], float], batches: list[Batch], warmup: int,
               device: torch.device) -> dict[str, Any]:
    """Run ``warmup`` untimed steps (the first compiles), then time one step per remaining
    batch; returns the medians ``{"step_ms", "forward_backward_ms", "optimizer_ms"}``,
    the optimizer's share of the step, ``first_step_s`` and ``final_loss``."""
    clock = PhaseClock(device)
    times, phases, loss = [], [], float("nan")
    first_step_s = 0.0
    for index, batch in enumerate(batches):
        elapsed, loss = time_once(lambda: step(batch, clock), device)
        spans = clock.phases_ms()
        if index == 0:
            first_step_s = elapsed
        if index >= warmup:
            times.append(elapsed)
            phases.append(spans)
    forward_backward_ms = statistics.median(p[0] for p in phases)
    optimizer_ms = statistics.median(p[1] for p in phases)
    return {"step_ms": 1e3 * statistics.median(times), "forward_backward_ms": forward_backward_ms,
            "optimizer_ms": optimizer_ms, "optimizer_share": optimizer_ms / (forward_backward_ms + optimizer_ms),
            "first_step_s": first_step_s, "final_loss": loss}


def compile_model(model: nn.Module, scope: str) -> nn.Module:
    """``torch.compile`` the whole model (scope "model"), or each transformer block in
    place (scope "blocks", as torchtitan does: identical blocks share one compiled
    graph, so a 20-block model compiles in about the time of one block)."""
    if scope == "model":
        return torch.compile(model)
    for block in transformer_blocks(model):
        block.compile()
    return model


def run_one(run: str, mode: str, config: Config, batches: list[Batch], warmup: int, device: torch.device,
            scope: str, to_torchao: Callable[..., Any] | None) -> dict[str, Any]:
    """Build and time one run in one mode ("compiled" with ``scope`` "blocks" or "model",
    or "eager"), from a fresh compiler; an error is recorded as ``{"error"}``."""
    reset_compiler()
    free_memory(device)
    model = optimizer = module = None
    slots = mock.patch.object(weight_grad, "COMPILED_SLOT_MIN_ELEMENTS", 1 << 22) if run.endswith("compiled slots") \
        else contextlib.nullcontext()
    try:
        model, optimizer = build(run, config, device, to_torchao)
        module = compile_model(model, scope) if mode == "compiled" else model
        with slots:
            result = time_steps(lambda b, clock: train_step(module, optimizer, b, device.type == "cuda", clock),
                                batches, warmup, device)
    except Exception as error:  # recorded in the JSON, the next run goes on
        return {"mode": mode, "error": error_text(error)}
    finally:
        model = optimizer = module = None  # free before the next run is built
    result["mode"] = f"compiled ({scope})" if mode == "compiled" else "eager"
    if mode == "compiled":
        result["graph_breaks"] = graph_break_count()
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def add_ratios(rows: dict[str, dict[str, Any]], tokens_per_step: int) -> None:
    """Tokens/s of each run of one mode and its ratios to that mode's baseline (above 1:
    faster), for the whole step and for forward+backward alone."""
    for row in rows.values():
        if "step_ms" in row:
            row["tokens_per_s"] = tokens_per_step / (row["step_ms"] / 1e3)
    base = rows.get("baseline", {})
    for row in rows.values():
        if "step_ms" in row and "step_ms" in base:
            row["vs_baseline"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["forward_backward_vs_baseline"] = base["forward_backward_ms"] / row["forward_backward_ms"]


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def print_table(results: dict[str, dict[str, dict[str, Any]]], title: str) -> None:
    """The runs as a rich table, one row per run and mode."""
    table = Table(title=title)
    for column in ("run", "mode", "step ms", "fwd+bwd ms", "optim ms", "optim share", "tokens/s",
                   "vs baseline", "fwd+bwd vs", "peak GiB", "loss"):
        table.add_column(column, justify="right")
    for name, modes in results.items():
        for mode, r in modes.items():
            if "step_ms" not in r:
                table.add_row(name, mode, "skipped" if "skipped" in r else "error", *["-"] * 8)
                continue
            peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
            table.add_row(name, r["mode"], f"{r['step_ms']:.1f}", f"{r['forward_backward_ms']:.1f}",
                          f"{r['optimizer_ms']:.1f}", f"{100 * r['optimizer_share']:.0f}%",
                          f"{r['tokens_per_s']:.0f}", _ratio(r, "vs_baseline"), _ratio(r, "forward_backward_vs_baseline"),
                          peak, f"{r['final_loss']:.3f}")
    default_console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the preset defaults to gpt-1b on CUDA and tiny on the CPU."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="model shape (default: gpt-1b on CUDA, tiny on the CPU)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first; the first compiles")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="runs, in this order")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="compiled and/or eager; every run of the first mode goes before the second")
    parser.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                        help="torch.compile each transformer block (default) or the whole model")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    if args.preset is None:
        args.preset = "gpt-1b" if torch.device(args.device).type == "cuda" else "tiny"
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
    tokens_per_step = args.batch_size * config.block_size
    with torch.device("meta"):  # counts without allocating
        parameters = sum(p.numel() for p in config.build().parameters())
    name = "gpt" if args.preset in GPT_PRESETS else f"gpt-{args.preset}"
    results: dict[str, dict[str, dict[str, Any]]] = {}  # run -> mode -> row, as measured
    payload = {
        "preset": args.preset, "model": type(config).__name__, "config": dataclasses.asdict(config),
        "parameters": parameters, "batch_size": args.batch_size, "tokens_per_step": tokens_per_step,
        "warmup": args.warmup, "steps": args.steps, "compile_scope": args.compile_scope,
        "baseline": baseline, "fp8": "emulated on the CPU" if not cuda else "torch._scaled_mm on CUDA",
        "amp8_optimizer": "LowBitAdam's default step: fused (compiled per tensor) on CUDA",
        "phases": "forward_backward_ms and optimizer_ms: medians on the device's clock (CUDA events); "
                  "step_ms: median wall clock of the whole step",
        "torchao": torchao_status, "runs": results,
    }
    for mode in args.modes:
        for run in args.runs:
            if run.startswith("torchao") and to_torchao is None:
                row = {"skipped": torchao_status}
            elif run.endswith("compiled casts") and mode == "compiled":
                row = {"skipped": "under torch.compile the casts are compiled with the model: the run without it"}
            elif run.endswith("compiled slots") and mode == "eager":
                row = {"skipped": "an eager backward writes every FP8 gradient into its slot: amp8 O2"}
            else:
                row = run_one(run, mode, config, batches, args.warmup, device, args.compile_scope, to_torchao)
            results.setdefault(run, {})[mode] = row
            add_ratios({r: modes[mode] for r, modes in results.items() if mode in modes}, tokens_per_step)
            path = write_result(name, device, payload, args.out)
            print(f"{run}, {mode}: done", flush=True)
    emulated = " (CPU: FP8 GEMMs are emulated, slower than FP32 by design)" if not cuda else ""
    print_table(results, f"{args.preset} ({parameters / 1e6:.1f}M params) training step vs "
                         f"{baseline} on {device_name(device)}{emulated}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
