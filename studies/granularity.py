"""SQNR of tensorwise, rowwise and block FP8 scaling and of the MXFP8 and NVFP4 recipes,
on well-behaved and outlier inputs.

    python studies/granularity.py               # M=1024, K=1024, N=768 on the CPU
    python studies/granularity.py --m 4096 --k 4096 --n 4096 --device cuda

The three FP8 granularities use E4M3 for every tensor and power-of-two scales, so only
the granularity differs; "mxfp8" and "nvfp4" are ``Recipe.preset``'s microscaled
recipes (emulated exactly where the GPU is not sm_100+), and NVFP4 is measured again
without its Hadamard transform and without stochastic gradient rounding, one knob at a
time. For each input case the study measures, against FP32 on the same
real operands: the three GEMMs on their own (fprop x W^T, dgrad g W, wgrad g^T x, each
operand cast with scales along its contraction dimension) and an Fp8Linear's output,
input gradient and (FP8-stored) weight gradient. Two numbers per cell: the SQNR of the
whole tensor, and the median over rows of each row's SQNR (what a typical token or
output feature sees: a whole-tensor SQNR is dominated by the outliers' energy).
Results go to studies/results/granularity-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.table import Table
from torch import nn

from amp8 import Recipe
from amp8.config.gemms import Gemm
from amp8.monitor.console import default_console
from amp8.nn import Fp8Linear, TensorRole
from amp8.ops.gemm import fp8_gemm
from amp8.quant.scaling import sqnr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import device_name, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

GRANULARITIES = ("tensorwise", "rowwise", "block")
NVFP4 = Recipe.preset("nvfp4")
RECIPES: dict[str, Recipe] = {
    **{granularity: Recipe(fp8_format="E4M3", power_of_2_scales=True, granularity=granularity)
       for granularity in GRANULARITIES},
    "mxfp8": Recipe.preset("mxfp8"),
    "nvfp4": NVFP4,
    "nvfp4 no-hadamard": NVFP4.replace(wgrad_hadamard=False),
    "nvfp4 no-sr": NVFP4.replace(stochastic_grad_rounding=False),
}
"""The recipes the study compares, by the label its table and JSON give them."""
OUTLIER_ROW_FACTOR = 3e4  # every 64th token of x and of the output gradient
OUTLIER_CHANNEL_FACTOR = 30.0  # every 128th input channel of x
COLUMNS = ("fprop", "dgrad", "wgrad", "y", "dx", "dW")


def row_sqnr(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Median over rows of the per-row SQNR, in dB."""
    reference = reference.detach().double()
    noise = approximation.detach().double() - reference
    return float((10 * torch.log10(reference.pow(2).sum(1) / noise.pow(2).sum(1))).median())


def inputs(m: int, k: int, n: int, outliers: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """x (M, K), a weight (N, K), an output gradient g (M, N); with outlier tokens and
    channels when ``outliers``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    grad = torch.randn(m, n, generator=generator)
    if outliers:
        x[::64] *= OUTLIER_ROW_FACTOR
        x[:, ::128] *= OUTLIER_CHANNEL_FACTOR
        grad[::64] *= OUTLIER_ROW_FACTOR
    return {"x": x.to(device), "weight": weight.to(device), "grad": grad.to(device)}


def measure(recipe: Recipe, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(SQNR, median row SQNR) of the three GEMMs and of Fp8Linear's outputs."""
    x, weight, grad = tensors["x"], tensors["weight"], tensors["grad"]
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=False, device=x.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
    layer = Fp8Linear.from_linear(linear, recipe)
    weight = layer.read_weight()  # the real weight both sides use (FP16-stored)

    def operand(role: TensorRole, t: torch.Tensor, contract_dim: int):
        return layer.cast(role, t, contract_dim, record=False)

    def column_major(t):  # the second operand: (K, N) column-major
        return t.with_data(t.data.t().contiguous().t())

    def row_major(t):  # the first operand: (M, K) row-major
        return t.with_data(t.data.contiguous())

    results = {}
    gemms = {
        "fprop": (x @ weight.t(), lambda: fp8_gemm(
            operand(TensorRole.INPUT, x, 1), operand(TensorRole.WEIGHT, weight, 1).t(), torch.float32, Gemm.FPROP)),
        "dgrad": (grad @ weight, lambda: fp8_gemm(
            operand(TensorRole.GRAD_OUTPUT, grad, 1), column_major(operand(TensorRole.WEIGHT, weight, 0)),
            torch.float32, Gemm.DGRAD)),
        "wgrad": (grad.t() @ x, lambda: fp8_gemm(
            row_major(operand(TensorRole.GRAD_OUTPUT, grad, 0).t()), column_major(operand(TensorRole.INPUT, x, 0)),
            torch.float32, Gemm.WGRAD)),
    }
    for name, (reference, run) in gemms.items():
        out = run()
        results[name] = (sqnr(reference, out), row_sqnr(reference, out))
    x_in = x.clone().requires_grad_(True)
    y = layer(x_in)
    y.backward(grad)
    x_ref = x.clone().requires_grad_(True)
    y_ref = x_ref @ weight.t()
    y_ref.backward(grad)
    for name, reference, got in (
        ("y", y_ref, y), ("dx", x_ref.grad, x_in.grad), ("dW", grad.t() @ x, layer.weight_grad.dequantize()),
    ):
        results[name] = (sqnr(reference, got), row_sqnr(reference, got))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=768)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for case in ("well-behaved", "outliers"):
        tensors = inputs(args.m, args.k, args.n, case == "outliers", device)
        for label, recipe in RECIPES.items():
            rows.append({"case": case, "recipe": label, "granularity": recipe.granularity.value,
                         "microscaling": recipe.microscaling.value, **measure(recipe, tensors)})
    table = Table(title=f"SQNR (dB): whole tensor / median row, M={args.m} K={args.k} N={args.n}, "
                        f"{device_name(device)}; FP8 granularities E4M3 with power-of-two scales")
    for column in ("case", "recipe", *COLUMNS):
        table.add_column(column, justify="left" if column in ("case", "recipe") else "right")
    for row in rows:
        table.add_row(row["case"], row["recipe"],
                      *(f"{row[c][0]:.1f} / {row[c][1]:.1f}" for c in COLUMNS))
    default_console().print(table)
    blackwell = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)
    payload = {
        "shape": {"m": args.m, "k": args.k, "n": args.n},
        "microscaled_gemms": "torch._scaled_mm" if blackwell else
                             "exact emulation: block dequantize, float32 products and sums, bfloat16 output",
        "outliers": {"row_factor": OUTLIER_ROW_FACTOR, "channel_factor": OUTLIER_CHANNEL_FACTOR},
        "rows": [{**{k: v for k, v in row.items() if k not in COLUMNS},
                  **{c: {"sqnr_db": row[c][0], "median_row_sqnr_db": row[c][1]} for c in COLUMNS}}
                 for row in rows],
    }
    path = write_result("granularity", device, payload, RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
