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
the rowwise preset. Every variant runs on the same weights and routing, in rounds that
take each variant once, so the ratios are measured side by side under the same machine
load; the medians and their ratios to the baseline go to
bench/results/moe-gemm-<device>.json. On the CPU the FP8 GEMMs are emulated: the numbers
say what FP8's casts and grouping cost there, not what an FP8 GPU gains.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

from amp8 import Recipe
from amp8.monitor.console import default_console
from amp8.nn import Fp8Experts
from common import RESULTS, synchronize, write_result

# (label, tokens, hidden H, intermediate I, experts E, top_k, routing)
CASES = [
    ("Mixtral-like, 8 experts top-2", 1024, 512, 1024, 8, 2, "uniform"),
    ("DeepSeek-like, 64 experts top-6", 1024, 512, 256, 64, 6, "uniform"),
    ("skewed: half the tokens to one expert", 1024, 512, 1024, 8, 2, "skewed"),
]
QUICK_CASES = [("quick", 64, 64, 32, 4, 2, "uniform")]
CANDIDATES = {"Fp8Experts tensorwise": Recipe(), "Fp8Experts rowwise (default)": Recipe.preset("rowwise")}
BASELINE = "per-expert loop FP32"
GROUPED = "grouped_mm FP32"


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


def measure(case: tuple, device: torch.device, warmup: int, rounds: int) -> dict[str, Any]:
    """Median step times (ms) of the baseline and each candidate on one case, in rounds."""
    label, tokens, hidden, intermediate, experts, top_k, kind = case
    torch.manual_seed(0)
    baseline = LoopExperts(experts, hidden, intermediate).to(device)
    grouped = GroupedExperts(experts, hidden, intermediate).to(device)
    grouped.load_state_dict(baseline.state_dict())
    modules: dict[str, nn.Module] = {BASELINE: baseline, GROUPED: grouped}
    for name, recipe in CANDIDATES.items():
        modules[name] = Fp8Experts.from_module(copy.deepcopy(baseline), recipe)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, device=device)
    index, weights = routing(tokens, experts, top_k, kind, device)
    calls: dict[str, Callable[[], None]] = {
        name: (lambda m=module: step(m, x, index, weights, grad)) for name, module in modules.items()
    }
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    counts = torch.bincount(index.flatten(), minlength=experts)
    return {
        "case": label, "tokens": tokens, "hidden": hidden, "intermediate": intermediate, "experts": experts,
        "top_k": top_k, "routing": kind, "max_tokens_per_expert": int(counts.max()),
        "ms": ms, "ratio_to_baseline": {name: ms[name] / ms[BASELINE] for name in (GROUPED, *CANDIDATES)},
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
    table = Table(title=f"MoE experts step (forward + backward), ms; ratio to the {BASELINE}")
    for column in ("case", BASELINE, GROUPED, *CANDIDATES):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        ratios = row["ratio_to_baseline"]
        cells = [f"{row['ms'][name]:.1f} ({ratios[name]:.2f}x)" for name in (GROUPED, *CANDIDATES)]
        table.add_row(row["case"], f"{row['ms'][BASELINE]:.1f}", *cells)
    default_console().print(table)
    payload = {
        "baseline": BASELINE,
        "reference": f"{GROUPED}: transformers' default experts implementation",
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
