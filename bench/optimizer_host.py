"""Host time and operations of one optimizer step over many small FP8 layers.

    python bench/optimizer_host.py                   # 2,000 layers of 32x32 with bias, O1/O2/O3
    python bench/optimizer_host.py --layers 10 200 2000

Over many small tensors an optimizer step is host work: one Python loop and a dozen
kernel launches per tensor cost far more than the arithmetic, on the CPU and on a GPU
alike. Each row times ``optimizer.step()`` (median of repeats, one thread), each step
right after an untimed ``zero_grad()``, forward and backward of its model as in training
(the FP8 gradients land where the step reads them; the layers' cached weight casts are
there to drop), for torch's ``AdamW(fused=True)`` over an FP32 copy of the same parameters and for
``LowBitAdam`` at each level: its default step (update groups over flat buffers, eager)
and the compiled group step (``fused=True``, compiled outside the timing, where a C++
compiler is found), each timed in turns with torch's step (a few warm steps of one, then
of the other, three times over) so that their ratio (``*_vs_torch``) holds on a busy
machine; and each tensor on its own (``grouped=False``, the reference; a few steps,
against torch's first time). It also counts the aten operations one step dispatches
(``counting.dispatched_operations``; a compiled graph counts as one call): what a GPU would launch, and what
must not grow with the number of parameters. Results go to bench/results/optimizer_host-<device>.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.optim import LowBitAdam
from amp8._compiled import cpp_compiler_found
from counting import dispatched_operations
from records import RESULTS, command_line, write_result
from timing import time_call, time_in_turns

WIDTH = 32
LEVELS = ("O1", "O2", "O3")


def small_layers(layers: int) -> nn.Module:
    """``layers`` WIDTH x WIDTH linear layers with bias."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def backward_pass(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What runs before each step, as in training: ``optimizer.zero_grad()``, then a
    forward and a backward of ``model`` (the gradients land where the step reads them,
    and the FP8 layers cache their weights' casts, which the step then drops)."""
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))

    def run() -> None:
        optimizer.zero_grad()
        model(batch).square().mean().backward()

    return run


def amp8_optimizer(layers: int, level: str, **options: Any) -> tuple[nn.Module, LowBitAdam]:
    """An amp8 model of ``layers`` FP8 layers and its LowBitAdam."""
    model, _ = amp8.initialize(small_layers(layers), None, level, layer_selection="all")
    optimizer = LowBitAdam.from_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), amp8.LEVELS[level], **options
    )
    return model, optimizer


def counted_step(optimizer: torch.optim.Optimizer, before: Callable[[], None]) -> int:
    """The aten operations (a compiled graph's call counted as one) of one step after ``before()``."""
    before()
    return dispatched_operations(optimizer.step)


def row(layers: int, repeats: int, compiled: bool) -> dict[str, Any]:
    """Milliseconds and operations per step at every level, against torch fused AdamW,
    each step timed right after its model's backward (``backward_pass``, untimed)."""
    device = torch.device("cpu")
    reference = small_layers(layers)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-4, fused=True)
    torch_before = backward_pass(reference, torch_adamw)
    result: dict[str, Any] = {
        "layers": layers, "parameters": 2 * layers,
        "torch_fused_adamw_ms": 1e3 * time_call(torch_adamw.step, device, 2, repeats, before=torch_before),
        "torch_fused_adamw_ops": counted_step(torch_adamw, torch_before),
    }
    for level in LEVELS:
        variants = {"grouped": {}, "per_tensor": {"grouped": False}}
        if compiled:
            variants["grouped_compiled"] = {"fused": True}
        for name, options in variants.items():
            model, optimizer = amp8_optimizer(layers, level, **options)
            before = backward_pass(model, optimizer)
            if name == "per_tensor":  # seconds a step at 2,000 layers: a few steps, against the first torch time
                ms = 1e3 * time_call(optimizer.step, device, 1, max(1, repeats // 10), before=before)
                torch_ms = result["torch_fused_adamw_ms"]
            else:  # timed in turn with torch's step, so the ratio holds on a busy machine
                torch_s, amp8_s = time_in_turns([torch_adamw.step, optimizer.step], device, max(1, repeats // 3),
                                                befores=[torch_before, before])
                ms, torch_ms = 1e3 * amp8_s, 1e3 * torch_s
            result[f"{level}_{name}_ms"] = ms
            result[f"{level}_{name}_vs_torch"] = ms / torch_ms
            result[f"{level}_{name}_ops"] = counted_step(optimizer, before)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 200, 2000], help="FP8 layers per model")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per row (a tenth for per_tensor)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled group step")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Measure every row, print the table, write the JSON (after every row)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    compiled = not args.no_compile and cpp_compiler_found()
    rows: list[dict[str, Any]] = []
    path = args.out
    for layers in args.layers:
        rows.append(row(layers, args.repeats, compiled))
        path = write_result("optimizer_host", torch.device("cpu"), {
            "command": command_line("optimizer_host.py", argv), "threads": 1,
            "layer": f"Linear({WIDTH}, {WIDTH}) with bias, layer_selection='all'", "rows": rows,
        }, args.out)
    table = Table(title="optimizer step over small FP8 layers: ms (ops) per step, one thread, and x torch's")
    variants = ("grouped", "per tensor", "compiled")
    for column in ["layers", "torch fused AdamW", *(f"{level} {name}" for level in LEVELS for name in variants)]:
        table.add_column(column, justify="right")
    for result in rows:
        cells = [str(result["layers"]), f"{result['torch_fused_adamw_ms']:.2f} ({result['torch_fused_adamw_ops']})"]
        for level in LEVELS:
            for name in ("grouped", "per_tensor", "grouped_compiled"):
                key = f"{level}_{name}"
                cells.append(f"{result[key + '_ms']:.2f} ({result[key + '_ops']}) {result[key + '_vs_torch']:.2f}x"
                             if key + "_ms" in result else "-")
        table.add_row(*cells)
    default_console().print(table)
    return path


if __name__ == "__main__":
    main()
