"""Fp8Linear forward + backward against nn.Linear and torchao's float8, eager and compiled.

    python bench/linear.py                          # the three headline shapes
    python bench/linear.py --quick                  # CPU-friendly: shapes up to 1e11 FLOP, 2 repeats
    python bench/linear.py --sweep                  # sweep shapes + the (K, N) grid at M=4096
    python bench/linear.py --device cuda --repeats 20 --out /tmp/results
    python bench/linear.py --shapes 64,128,64 --warmup 0 --repeats 1   # any shapes, here a tiny one

Variants, side by side in one process on the same inputs: nn.Linear (the baseline: BF16
autocast on CUDA, FP32 on the CPU, where there is no fast BF16 path), amp8's Fp8Linear,
each eager and under torch.compile (one scale per tensor, and compiled with one scale per
row, ``Recipe.preset("rowwise")``), and torchao's float8 training (tensorwise and rowwise,
compiled, as torchao recommends) where torchao imports. On CUDA every variant gets BF16 inputs and
runs under BF16 autocast. The speedup of a variant is the faster nn.Linear (eager or
compiled) time over its time: above 1 means faster than the best baseline. A case that
fails (a compile error, say) is recorded in the JSON with its error and the run goes on.

``--sweep`` adds, for each (K, N) of the grid at M = ``--sweep-m``, the speedups of eager
and compiled Fp8Linear, and the K and N thresholds of the rule "FP8 where faster"
(``amp8.nn.selection.SpeedRule.fit``; ``amp8.nn.selection.SpeedRule.from_json(path)`` reads it). Results go to ``--out`` (bench/results/):
linear-<device>.json, or linear-sweep-<device>.json with ``--sweep``; the file is
rewritten after each shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

from dataclasses import asdict

from amp8 import Recipe
from amp8.monitor.console import default_console
from amp8.nn import Fp8Linear
from amp8.nn.selection import SpeedRule
from common import graph_break_count, reset_compiler, torchao_float8
from records import RESULTS, device_name, error_text, write_result
from timing import measure

Shape = tuple[int, int, int]

HEADLINE: list[Shape] = [(1024, 2048, 1024), (4096, 8192, 16384), (8192, 8192, 8192)]
SWEEP: list[Shape] = [
    (256, 512, 256), (1024, 1024, 1024), (1024, 2048, 1024), (2048, 4096, 2048),
    (4096, 4096, 4096), (4096, 8192, 16384), (8192, 8192, 8192),
]
GRID_SIZES = (1024, 2048, 4096, 8192, 16384)
GRID_M = 4096
QUICK_FLOP_LIMIT = 1e11
BASELINES = ("nn.Linear", "nn.Linear compiled")
CANDIDATES = ("Fp8Linear", "Fp8Linear compiled casts", "Fp8Linear compiled", "Fp8Linear rowwise compiled",
              "torchao compiled", "torchao rowwise compiled")
"""The variants to time against the baselines; "Fp8Linear compiled casts" is an eager layer
whose casts run as amp8's compiled kernels (``compiled_casts=True``)."""


def shapes_to_run(sweep: bool, sweep_m: int, grid: tuple[int, ...], quick: bool,
                  listed: list[Shape] | None = None) -> list[Shape]:
    """The (M, K, N) cases in order, without repeats: ``listed`` (default: the headline
    shapes, or the sweep's), then with ``sweep`` the grid; with ``quick`` only those up to
    ``QUICK_FLOP_LIMIT`` forward + backward FLOP."""
    first = listed if listed is not None else SWEEP if sweep else HEADLINE
    shapes = first + [(sweep_m, k, n) for k in grid for n in grid] if sweep else first
    unique = list(dict.fromkeys(shapes))
    return [s for s in unique if not quick or 6 * s[0] * s[1] * s[2] <= QUICK_FLOP_LIMIT]


def build(variant: str, k: int, n: int, device: torch.device, to_torchao: Callable[..., Any] | None) -> nn.Module:
    """A fresh one-layer module of ``variant`` (uncompiled), K inputs and N outputs."""
    linear = nn.Linear(k, n, device=device)
    rowwise = "rowwise" in variant
    if variant.startswith("Fp8Linear"):
        layer = Fp8Linear.from_linear(linear, Recipe.preset("rowwise") if rowwise else Recipe())
        layer.set_compiled_casts(variant.endswith("compiled casts"))
        return layer
    if variant.startswith("torchao"):
        return to_torchao(nn.Sequential(linear), recipe="rowwise" if rowwise else "tensorwise")
    return linear


def step_fn(
    module: nn.Module, x: torch.Tensor, grad: torch.Tensor, owner: nn.Module, autocast: bool
) -> Callable[[], None]:
    """One forward + backward of ``module`` (``owner`` or its compiled wrapper); clears the
    gradients it leaves behind (an FP8 weight's gradient is its Parameter's ``.grad``)."""
    def step() -> None:
        context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            y = module(x)
        y.backward(grad)
        x.grad = None
        for param in owner.parameters():
            param.grad = None
    return step


def run_variant(
    variant: str, shape: Shape, device: torch.device, to_torchao: Callable[..., Any] | None,
    warmup: int, repeats: int,
) -> dict[str, Any]:
    """Time one variant at one shape: ``{"ms", "tflops", "first_call_s"[, "graph_breaks"]}``
    or ``{"error"}``."""
    m, k, n = shape
    compiled = variant.endswith("compiled")
    reset_compiler()
    try:
        owner = build(variant, k, n, device, to_torchao)
        module = torch.compile(owner) if compiled else owner
    except Exception as error:  # torchao's conversion, for one
        return {"error": error_text(error)}
    on_cuda = device.type == "cuda"
    # On CUDA every variant sees BF16 activations and gradients, as in a BF16 model.
    act_dtype = torch.bfloat16 if on_cuda else torch.float32
    x = torch.randn(m, k, device=device, dtype=act_dtype, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=act_dtype)
    result = measure(step_fn(module, x, grad, owner, on_cuda), device, warmup, repeats)
    if "ms" in result:
        result["tflops"] = 6 * m * k * n / result["ms"] / 1e9  # forward + two backward GEMMs
    if compiled:
        result["graph_breaks"] = graph_break_count()
    return result


def run_shape(shape: Shape, device: torch.device, to_torchao: Callable[..., Any] | None,
              warmup: int, repeats: int, compile: bool) -> dict[str, Any]:
    """Every variant at ``shape``, with speedups against the faster baseline."""
    m, k, n = shape
    variants: dict[str, dict[str, Any]] = {}
    for variant in BASELINES + CANDIDATES:
        if ("compiled" in variant) and not compile:  # "compiled casts" compiles too
            variants[variant] = {"skipped": "--no-compile"}
        elif variant.startswith("torchao") and to_torchao is None:
            variants[variant] = {"skipped": "torchao unavailable"}
        else:
            variants[variant] = run_variant(variant, shape, device, to_torchao, warmup, repeats)
    baselines = [variants[b]["ms"] for b in BASELINES if "ms" in variants[b]]
    baseline_ms = min(baselines) if baselines else None
    speedup = {
        c: baseline_ms / variants[c]["ms"] if baseline_ms and "ms" in variants[c] else None for c in CANDIDATES
    }
    return {"m": m, "k": k, "n": n, "flop": 6 * m * k * n, "variants": variants,
            "baseline_ms": baseline_ms, "speedup": speedup}


def layer_selection(rows: list[dict[str, Any]], m: int, grid: tuple[int, ...], device: str) -> dict[str, Any]:
    """The grid's speedups at M = ``m`` and the ``amp8.nn.selection.SpeedRule`` fitted to them (None
    where no cell was measured); ``speed_rule`` (compiled, else eager) is what
    ``amp8.nn.selection.SpeedRule.from_json`` reads from the JSON file."""
    cells = [
        {"k": r["k"], "n": r["n"], "speedup_eager": r["speedup"]["Fp8Linear"],
         "speedup_compiled": r["speedup"]["Fp8Linear compiled"]}
        for r in rows if r["m"] == m and r["k"] in grid and r["n"] in grid
    ]
    rules = {}
    for mode in ("eager", "compiled"):
        measured = [
            {"in_features": c["k"], "out_features": c["n"], "speedup": c[f"speedup_{mode}"]}
            for c in cells if c[f"speedup_{mode}"] is not None
        ]
        source = f"bench/linear.py --sweep, {mode} Fp8Linear, M={m}, {device}"
        rules[mode] = asdict(SpeedRule.fit(measured, source)) if measured else None
    return {"m": m, "cells": cells, "speed_rule_eager": rules["eager"],
            "speed_rule_compiled": rules["compiled"], "speed_rule": rules["compiled"] or rules["eager"]}


def _ms(variant: dict[str, Any]) -> str:
    return f"{variant['ms']:.2f}" if "ms" in variant else "error" if "error" in variant else "-"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_table(rows: list[dict[str, Any]], baseline: str, device: torch.device) -> None:
    """The rows as a rich table; FP8 TFLOP/s is that of the faster Fp8Linear variant."""
    emulated = " (CPU: FP8 GEMMs are emulated, slower than FP32 by design)" if device.type == "cpu" else ""
    table = Table(title=f"Fp8Linear fwd+bwd vs {baseline} on {device_name(device)}{emulated}")
    for column in ("M", "K", "N", "nn.Linear ms", "compiled ms", "Fp8Linear ms", "casts ms", "compiled ms",
                   "rowwise ms", "torchao ms", "ao rowwise ms", "Fp8Linear", "casts", "compiled", "rowwise",
                   "torchao", "ao rowwise", "FP8 TFLOP/s"):
        table.add_column(column, justify="right")
    for row in rows:
        v = row["variants"]
        tflops = [v[c]["tflops"] for c in ("Fp8Linear", "Fp8Linear compiled casts", "Fp8Linear compiled")
                  if "tflops" in v[c]]
        table.add_row(
            str(row["m"]), str(row["k"]), str(row["n"]),
            *(_ms(v[name]) for name in BASELINES + CANDIDATES),
            *(_x(row["speedup"][c]) for c in CANDIDATES),
            f"{max(tflops):.3f}" if tflops else "-",
        )
    default_console().print(table)


def _shape(text: str) -> Shape:
    """``"M,K,N"`` as a shape of three positive ints."""
    try:
        m, k, n = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not M,K,N; write three ints, e.g. 64,128,64") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} has a size below 1; every size must be >= 1")
    return m, k, n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` lowers the repeats unless they are given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"only shapes up to {QUICK_FLOP_LIMIT:g} FLOP; 1 warmup, 2 repeats")
    parser.add_argument("--sweep", action="store_true", help="sweep shapes and the (K, N) grid")
    parser.add_argument("--sweep-m", type=int, default=GRID_M, help="M of the (K, N) grid")
    parser.add_argument("--grid", type=int, nargs="+", default=list(GRID_SIZES), help="K and N values of the grid")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls after the first (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls, median reported (default 5)")
    parser.add_argument("--shapes", type=_shape, nargs="+", default=None, metavar="M,K,N",
                        help="shapes to time instead of the headline (or sweep) shapes, e.g. 64,128,64")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the JSON written."""
    args = parse_args(argv)
    device = torch.device(args.device)
    grid = tuple(args.grid)
    to_torchao, torchao_status = torchao_float8()
    baseline = "nn.Linear BF16 autocast" if device.type == "cuda" else "nn.Linear FP32"
    name = "linear-sweep" if args.sweep else "linear"
    payload: dict[str, Any] = {
        "baseline": baseline, "fp8": "emulated on the CPU" if device.type == "cpu" else "torch._scaled_mm on CUDA",
        "speedup": "faster of nn.Linear eager / compiled ms over the variant's ms",
        "warmup": args.warmup, "repeats": args.repeats, "torchao": torchao_status, "rows": [],
    }
    print(f"torchao: {torchao_status}", flush=True)
    for shape in shapes_to_run(args.sweep, args.sweep_m, grid, args.quick, args.shapes):
        payload["rows"].append(run_shape(shape, device, to_torchao, args.warmup, args.repeats, not args.no_compile))
        if args.sweep:
            payload["layer_selection"] = layer_selection(payload["rows"], args.sweep_m, grid, device_name(device))
        path = write_result(name, device, payload, args.out)
        print(f"{shape} done", flush=True)
    print_table(payload["rows"], baseline, device)
    if args.sweep:
        selection = payload["layer_selection"]
        print(f"speed rule at M={args.sweep_m}: eager {selection['speed_rule_eager']}, "
              f"compiled {selection['speed_rule_compiled']}")
    path = write_result(name, device, payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
