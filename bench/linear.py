"""Fp8Linear forward + backward against nn.Linear, over a sweep of (M, K, N) shapes.

    python bench/linear.py                 # every shape on the default device
    python bench/linear.py --quick         # skip shapes above 1e11 FLOP (CPU-friendly)
    python bench/linear.py --device cuda --repeats 20

The baseline is nn.Linear in FP32 on the CPU and under BF16 autocast on CUDA. Both run in
the same process on the same inputs; the ratio is baseline time / Fp8Linear time (above
1 means FP8 is faster). Results go to bench/results/linear-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from rich.table import Table
from torch import nn

from amp8 import Recipe
from amp8.console import default_console
from amp8.nn import Fp8Linear
from common import device_name, time_call, write_result

SHAPES = [
    (256, 512, 256), (1024, 1024, 1024), (1024, 2048, 1024), (2048, 4096, 2048),
    (4096, 4096, 4096), (4096, 8192, 16384), (8192, 8192, 8192),
]
QUICK_FLOP_LIMIT = 1e11


def step_fn(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool):
    """One forward + backward of ``layer``; clears the gradients it leaves behind."""
    def step() -> None:
        context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            y = layer(x)
        y.backward(grad)
        x.grad = None
        layer.weight.grad = None
        if isinstance(layer, Fp8Linear):
            layer.weight_grad = None
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help=f"skip shapes above {QUICK_FLOP_LIMIT:g} FLOP")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    rows = []
    for m, k, n in SHAPES:
        flop = 6 * m * k * n  # forward + two backward GEMMs
        if args.quick and flop > QUICK_FLOP_LIMIT:
            continue
        baseline = nn.Linear(k, n, device=device)
        fp8 = Fp8Linear.from_linear(nn.Linear(k, n, device=device), Recipe())
        # On CUDA both layers see BF16 activations and gradients, as in a BF16 model.
        act_dtype = torch.bfloat16 if on_cuda else torch.float32
        x = torch.randn(m, k, device=device, dtype=act_dtype, requires_grad=True)
        grad = torch.randn(m, n, device=device, dtype=act_dtype)
        base_s = time_call(step_fn(baseline, x, grad, on_cuda), device, args.warmup, args.repeats)
        fp8_s = time_call(step_fn(fp8, x, grad, False), device, args.warmup, args.repeats)
        rows.append({
            "m": m, "k": k, "n": n,
            "baseline_ms": 1e3 * base_s, "fp8_ms": 1e3 * fp8_s,
            "speedup": base_s / fp8_s,
            "fp8_tflops": flop / fp8_s / 1e12,
        })
        print(f"({m}, {k}, {n}) done", flush=True)
    baseline_name = "nn.Linear BF16 autocast" if on_cuda else "nn.Linear FP32"
    table = Table(title=f"Fp8Linear fwd+bwd vs {baseline_name} on {device_name(device)}")
    for column in ("M", "K", "N", "baseline ms", "Fp8Linear ms", "speedup", "FP8 TFLOP/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["m"]), str(row["k"]), str(row["n"]), f"{row['baseline_ms']:.2f}",
                      f"{row['fp8_ms']:.2f}", f"{row['speedup']:.2f}x", f"{row['fp8_tflops']:.3f}")
    default_console().print(table)
    path = write_result("linear", device, {"baseline": baseline_name, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
