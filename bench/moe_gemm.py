"""Step time of amp8's FP8 experts against the per-expert high-precision loop.

    OMP_NUM_THREADS=1 python bench/moe_gemm.py          # CPU, the recorded run
    python bench/moe_gemm.py --quick                     # one tiny case
    python bench/moe_gemm.py --device cuda

One step is forward and backward (input and weight gradients) of one MoE layer's experts:
(tokens, H) hidden states routed to ``top_k`` of E experts, each ``down(silu(gate(x)) *
up(x))`` with transformers' 3-D weight layout. The baseline is the per-expert loop in
FP32 (one matmul per expert and projection); transformers' default implementation (one
``torch.nn.functional.grouped_mm`` per projection, FP32) runs beside it; the candidates
are ``amp8.nn.Fp8Experts`` at the tensorwise recipe and at ``amp8.initialize``'s default,
the rowwise preset, with their weights stored as O1 and O2 store them (FP16 and one
scale, FP8 weight gradients).

The yardstick is what FP8 costs a dense layer on the same device at the experts' GEMM
shapes: one expert's mean share of the routed rows (tokens x top_k / E) through a dense
MLP of an expert's shapes, two FP32 ``nn.Linear`` s against two ``amp8.nn.Fp8Linear`` s of
the same recipe and storage, which cast their weights at every step as training does.
The experts meet their target when their ratio to the loop is at most the dense layers'
ratio (``experts_over_dense`` at most 1). (All routed rows through one such MLP would be
the same FLOPs with E / top_k times fewer weight elements to cast: on the CPU, where
casts cost about as much as the emulated GEMMs, that flatters the dense layers.) Every variant runs on the same weights and routing,
in rounds that take each variant once, so the ratios are measured side by side under the
same machine load; the medians and their ratios go to bench/results/moe-gemm-<device>.json.
On the CPU the FP8 GEMMs are emulated: the numbers say what FP8's casts and grouping cost
there, not what an FP8 GPU gains.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

from amp8 import Recipe
from amp8.config.levels import Precision
from amp8.monitor.console import default_console
from amp8.nn import Fp8Experts, Fp8Linear
from records import RESULTS, write_result
from timing import time_in_turns

# (label, tokens, hidden H, intermediate I, experts E, top_k, routing)
CASES = [
    ("Mixtral-like, 8 experts top-2", 1024, 512, 1024, 8, 2, "uniform"),
    ("DeepSeek-like, 64 experts top-6", 1024, 512, 256, 64, 6, "uniform"),
    ("skewed: half the tokens to one expert", 1024, 512, 1024, 8, 2, "skewed"),
]
QUICK_CASES = [("quick", 64, 64, 32, 4, 2, "uniform")]
RECIPES = {"tensorwise": Recipe(), "rowwise (default)": Recipe.preset("rowwise")}
CANDIDATES = {f"Fp8Experts {name}": recipe for name, recipe in RECIPES.items()}
DENSE_FP8 = {f"dense Fp8Linear {name}": recipe for name, recipe in RECIPES.items()}
STORAGE = Precision.FP16  # the experts' and the dense layers' weights, as O1 and O2 store them
BASELINE = "per-expert loop FP32"
GROUPED = "grouped_mm FP32"
DENSE = "dense MLP FP32"


class LoopExperts(nn.Module):
    """The per-expert loop in high precision: one matmul per expert and projection.

    The weights are unbound once per forward; transformers' eager experts index them per
    expert instead (``gate_up_proj[expert]``), whose backward allocates a zero gradient of
    the whole (E, 2I, H) tensor for every expert: with 64 experts that alone takes several
    times the GEMMs' time on the CPU, so it would flatter any other implementation.
    """

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * intermediate, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, intermediate) / intermediate**0.5)
        self.act_fn = nn.SiLU()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert, (gate_up, down) in enumerate(zip(self.gate_up_proj.unbind(0), self.down_proj.unbind(0))):
            tokens, slots = torch.where(top_k_index == expert)
            if tokens.numel() == 0:
                continue
            gate, up = nn.functional.linear(hidden_states[tokens], gate_up).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, down)
            out = out.index_add(0, tokens, y * top_k_weights[tokens, slots, None])
        return out


class GroupedExperts(LoopExperts):
    """transformers' default experts implementation ("grouped_mm"): the pairs sorted by
    expert, one ``torch.nn.functional.grouped_mm`` per projection, in high precision."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        experts, order = torch.sort(top_k_index.reshape(-1))
        offsets = torch.cumsum(torch.bincount(experts, minlength=self.gate_up_proj.shape[0]), 0).to(torch.int32)
        x = hidden_states[order // k]
        projected = nn.functional.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = projected.chunk(2, dim=-1)
        activated = (self.act_fn(gate) * up).contiguous()  # CPU grouped_mm's backward needs dense strides
        y = nn.functional.grouped_mm(activated, self.down_proj.transpose(-2, -1), offs=offsets)
        y = y * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, order // k, y)


class DenseMlp(nn.Module):
    """One dense MLP of an expert's shapes, ``down(silu(gate(x)) * up(x))``: run on one
    expert's mean share of the rows, the GEMM shapes of the experts, without routing."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(rows).chunk(2, dim=-1)
        return self.down(self.act_fn(gate) * up)


def fp8_mlp(mlp: DenseMlp, recipe: Recipe) -> DenseMlp:
    """A copy of ``mlp`` with both linear layers ``Fp8Linear`` s of ``recipe``, weights at ``STORAGE``."""
    fp8 = copy.deepcopy(mlp)
    fp8.gate_up = Fp8Linear.from_linear(fp8.gate_up, recipe, STORAGE)
    fp8.down = Fp8Linear.from_linear(fp8.down, recipe, STORAGE)
    return fp8


def routing(
    tokens: int, experts: int, top_k: int, kind: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, top_k) distinct experts per token and their softmax weights; "skewed"
    sends half the tokens' first choice to expert 0."""
    logits = torch.randn(tokens, experts, device=device)
    if kind == "skewed":
        logits[: tokens // 2, 0] += 100.0
    weights, index = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def step(module: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward and backward of ``module``, gradients cleared first."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x, index, weights).backward(grad)


def dense_step(module: nn.Module, rows: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward and backward of the dense MLP, gradients cleared first. The FP8 layers
    forget their cached FP8 weights first, as every optimizer step makes them (the
    experts cast theirs at every forward)."""
    for layer in module.modules():
        if isinstance(layer, Fp8Linear):
            layer.drop_weight_cache()
    module.zero_grad(set_to_none=True)
    rows.grad = None
    module(rows).backward(grad)


def measure(case: tuple, device: torch.device, warmup: int, rounds: int) -> dict[str, Any]:
    """Median step times (ms) of the baseline and each candidate on one case, in rounds."""
    label, tokens, hidden, intermediate, experts, top_k, kind = case
    torch.manual_seed(0)
    baseline = LoopExperts(experts, hidden, intermediate).to(device)
    grouped = GroupedExperts(experts, hidden, intermediate).to(device)
    grouped.load_state_dict(baseline.state_dict())
    modules: dict[str, nn.Module] = {BASELINE: baseline, GROUPED: grouped}
    for name, recipe in CANDIDATES.items():
        modules[name] = Fp8Experts.from_module(copy.deepcopy(baseline), recipe, STORAGE)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device)
    index, weights = routing(tokens, experts, top_k, kind, device)
    calls: dict[str, Callable[[], None]] = {
        name: (lambda m=module: step(m, x, index, weights, grad)) for name, module in modules.items()
    }
    dense = DenseMlp(hidden, intermediate).to(device)
    share = max(16, tokens * top_k // experts)  # one expert's mean rows
    rows = torch.randn(share, hidden, device=device, requires_grad=True)
    row_grad = torch.randn(share, hidden, device=device)
    mlps = {DENSE: dense, **{name: fp8_mlp(dense, recipe) for name, recipe in DENSE_FP8.items()}}
    for name, mlp in mlps.items():
        calls[name] = lambda m=mlp: dense_step(m, rows, row_grad)
    for call in calls.values():
        for _ in range(warmup):
            call()
    seconds = time_in_turns(list(calls.values()), device, repeats=1, rounds=rounds, warmup=0)
    ms = {name: 1e3 * median for name, median in zip(calls, seconds, strict=True)}
    counts = torch.bincount(index.flatten(), minlength=experts)
    ratios = {name: ms[name] / ms[BASELINE] for name in (GROUPED, *CANDIDATES)}
    dense_ratios = {name: ms[name] / ms[DENSE] for name in DENSE_FP8}
    return {
        "case": label, "tokens": tokens, "hidden": hidden, "intermediate": intermediate, "experts": experts,
        "top_k": top_k, "routing": kind, "max_tokens_per_expert": int(counts.max()), "dense_rows": share,
        "ms": ms, "ratio_to_baseline": ratios, "dense_fp8_ratio": dense_ratios,
        "experts_over_dense": {
            recipe: ratios[f"Fp8Experts {recipe}"] / dense_ratios[f"dense Fp8Linear {recipe}"] for recipe in RECIPES
        },
    }


def main(argv: list[str] | None = None) -> Path:
    """Run the cases, print a table and write the JSON; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one tiny case (a smoke test)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(case, device, args.warmup, args.rounds) for case in (QUICK_CASES if args.quick else CASES)]
    table = Table(title=f"MoE experts step (forward + backward), ms; ratio to the {BASELINE} "
                        f"(experts) or the {DENSE} (dense)")
    for column in ("case", BASELINE, GROUPED, *CANDIDATES, DENSE, *DENSE_FP8, "experts / dense ratio"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        ratios = {**row["ratio_to_baseline"], **row["dense_fp8_ratio"]}
        cells = [f"{row['ms'][name]:.1f} ({ratios[name]:.2f}x)" for name in (GROUPED, *CANDIDATES)]
        dense = [f"{row['ms'][name]:.1f} ({ratios[name]:.2f}x)" for name in DENSE_FP8]
        over = ", ".join(f"{value:.2f}" for value in row["experts_over_dense"].values())
        table.add_row(row["case"], f"{row['ms'][BASELINE]:.1f}", *cells, f"{row['ms'][DENSE]:.1f}", *dense, over)
    default_console().print(table)
    payload = {
        "baseline": BASELINE,
        "reference": f"{GROUPED}: transformers' default experts implementation",
        "dense_reference": f"{DENSE} against Fp8Linear of each recipe, one expert's mean rows, an expert's shapes",
        "weight_storage": STORAGE.name,
        "fp8": "emulated on the CPU" if device.type == "cpu" else "torch._scaled_mm / torch._scaled_grouped_mm",
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "rows": rows,
    }
    path = write_result("moe-gemm", device, payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
