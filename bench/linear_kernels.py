"""Kernels and bytes of one ``Fp8Linear`` forward + backward, eager and compiled, against
the least a layer must do.

    python bench/linear_kernels.py                          # 256 x 1024 x 1024, both recipes, O1 and O2
    python bench/linear_kernels.py --shape 64 256 512 --recipes rowwise --levels O2

The layer is warmed up by one step (its weight cast is cached, as in training), then one
forward and one backward under ``bench/counting.py``'s counter, BF16 autocast as
on CUDA, and one more forward with the weight's casts dropped, as the first forward after
an optimizer step runs it ("step's forward": the weight cast again): eagerly, every aten operation that runs a kernel counts one; compiled
(``torch.compile`` of the layer, or amp8's own compiled casts in an eager layer), each
graph counts the GPU kernels its generated code
stands for, with the bytes of their arguments. The least a layer must do:
- kernels: forward, one cast of the input and the GEMM (2); backward, one cast of the
  output gradient (the bias gradient summed in the same pass), the data-gradient and the
  weight-gradient GEMMs (3), each cast writing the transposed copy the other GEMM reads
  in the same pass;
- bytes: each operand read once at its input precision and written once in FP8 (the
  input and the output gradient, and their transposed copies), the GEMMs' FP8 operands
  read once each, and the output, input gradient and weight gradient written once.
The first step's time (the compiling, from a fresh compiler state but inductor's own
cache on disk) is recorded too. Results go to ``--out``/linear_kernels-<device>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from common import reset_compiler
from counting import StepCounter
from records import RESULTS, command_line, write_result
from timing import time_once

LEVELS = ("O1", "O2")
RECIPES = ("tensorwise", "rowwise")
MODES = ("eager-ops", "eager", "compiled")
"""eager-ops: the casts as eager operations (``set_compiled_casts(False)``, the CPU's
default); eager: the casts as amp8's compiled kernels, the rest eager (CUDA's default,
forced here); compiled: ``torch.compile`` of the layer."""
PHASES = ("forward", "backward", "step's forward")
LEAST_PHASES = PHASES[:2]  # what ``least`` sizes


def least(m: int, k: int, n: int, input_bytes: int) -> dict[str, dict[str, int]]:
    """The least kernels and bytes of one FP8 linear forward and backward (see the
    module docstring): inputs of ``input_bytes`` per element, FP8 casts of one byte, the
    weight's FP8 cast cached, the weight gradient written in FP8."""
    forward = (m * k * input_bytes + 2 * m * k  # the input read, its FP8 copy and transposed copy written
               + m * k + k * n + m * n * input_bytes)  # the GEMM: FP8 operands read, the output written
    backward = (m * n * input_bytes + 2 * m * n  # the output gradient read, its two FP8 copies written
                + m * n + k * n + m * k * input_bytes  # data gradient: FP8 operands read, written
                + m * k + m * n + k * n)  # weight gradient: FP8 operands read, written in FP8
    return {"forward": {"kernels": 2, "bytes": forward}, "backward": {"kernels": 3, "bytes": backward}}


def count(level: str, recipe: str, mode: str, shape: tuple[int, int, int]) -> dict[str, Any]:
    """One warmed-up forward + backward of an ``Fp8Linear`` of ``shape`` (M, K, N): per
    phase, kernels (eager operations plus compiled graphs' kernels) and bytes; and
    ``first_step_s``."""
    reset_compiler()
    m, k, n = shape
    torch.manual_seed(0)
    layer, _ = amp8.initialize(nn.Sequential(nn.Linear(k, n)), None, level, amp8.Recipe.preset(recipe),
                               layer_selection="all")
    for module in layer.modules():
        if isinstance(module, amp8.nn.Fp8Linear):
            module.set_compiled_casts(mode == "eager")
    run = torch.compile(layer) if mode == "compiled" else layer
    x = torch.randn(m, k, requires_grad=True)
    grad = torch.randn(m, n)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        out.backward(grad.to(out.dtype))

    def drop_weight_casts() -> None:  # as an optimizer step does
        for module in layer.modules():
            if isinstance(module, amp8.nn.Fp8Linear):
                module.drop_weight_cache()

    first_step_s, _ = time_once(step, torch.device("cpu"))  # compiles, and caches the weight's cast
    drop_weight_casts()
    step()  # compiles a forward that casts the weight again, if it needs another
    # As in training: gradients set to None after the step, so none is accumulated into.
    x.grad = None
    layer.zero_grad(set_to_none=True)
    counter = StepCounter()
    with counter:
        with counter.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        out_grad = grad.to(out.dtype)
        with counter.phase("backward"):
            out.backward(out_grad)
        drop_weight_casts()
        with counter.phase("step's forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            run(x)
    totals = counter.totals()
    counted: dict[str, Any] = {
        phase: {"kernels": totals[phase]["ops"] + totals[phase]["graph_kernels"],
                "graph_calls": totals[phase]["graph_calls"],
                "bytes": totals[phase]["bytes"] + totals[phase]["graph_bytes"],
                "fp8_flops": totals[phase]["fp8_flops"]} for phase in PHASES
    }
    counted["first_step_s"] = first_step_s  # compiling included, in a fresh compiler state
    return counted


def main(argv: list[str] | None = None) -> Path:
    """Count every level, recipe and mode; print the table and write the JSON; its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[256, 1024, 1024], metavar=("M", "K", "N"))
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = tuple(args.shape)
    minimum = least(*shape, input_bytes=2)  # BF16 under autocast
    rows = []
    table = Table(title=f"Fp8Linear {shape[0]} x {shape[1]} x {shape[2]}, forward / backward / step's forward "
                        "(casting the weight): kernels, MB "
                        f"(least: {minimum['forward']['kernels']} / {minimum['backward']['kernels']} kernels, "
                        f"{minimum['forward']['bytes'] / 1e6:.2f} / {minimum['backward']['bytes'] / 1e6:.2f} MB)")
    for column in ("level", "recipe", "mode", "kernels", "graph calls", "MB", "x least MB", "first step s"):
        table.add_column(column, justify="right")
    for level in args.levels:
        for recipe in args.recipes:
            for mode in args.modes:
                counted = count(level, recipe, mode, shape)
                rows.append({"level": level, "recipe": recipe, "mode": mode, **counted})
                table.add_row(level, recipe, mode,
                              " / ".join(f"{counted[p]['kernels']:.0f}" for p in PHASES),
                              " / ".join(f"{counted[p]['graph_calls']:.0f}" for p in PHASES),
                              " / ".join(f"{counted[p]['bytes'] / 1e6:.2f}" for p in PHASES),
                              " / ".join(f"{counted[p]['bytes'] / minimum[p]['bytes']:.1f}" for p in LEAST_PHASES),
                              f"{counted['first_step_s']:.2f}")
    default_console().print(table)
    return write_result("linear_kernels", torch.device("cpu"), {
        "command": command_line("linear_kernels.py", argv), "threads": 1,
        "shape": {"m": shape[0], "k": shape[1], "n": shape[2]}, "autocast": "bfloat16", "least": minimum,
        "counted_as": "kernels: eager aten operations that run a kernel plus compiled graphs' GPU kernels; bytes: "
                      "nbytes in + out of each eager operation plus the arguments of each generated kernel",
        "rows": rows,
    }, args.out)


if __name__ == "__main__":
    main()
