"""Low-bit AdamW step time against torch's AdamW, and bytes/param per opt level.

    python bench/optimizer.py                        # CPU: 10M and 30M parameters
    python bench/optimizer.py --sizes 10 30 100      # millions of parameters
    python bench/optimizer.py --device cuda

Step time: one optimizer step over square FP8 layers holding the given number of
parameters, with gradients already in place: torch.optim.AdamW (foreach on the CPU,
fused on CUDA) on an FP32 copy of the same model, and amp8's LowBitAdam with its
reference step (unfused) and its torch.compile'd step (fused), in the same process.
The fused step is compiled during warm-up, outside the timing. Bytes/param:
the precision report after one training step at each level, for amp8's byte-level GPT
(presets small and medium; tied head, so embeddings are a small share) and for a GPT-style
stack with an untied 4096-entry vocabulary (embeddings 20 % of its parameters, which stay
in FP32). Results go to bench/results/.
"""

from __future__ import annotations

import argparse

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.optim import LowBitAdam
from common import time_call, write_result

WIDTH = 1024


def square_layers(parameters: int, device: torch.device) -> nn.Module:
    """A stack of WIDTH x WIDTH linear layers holding about ``parameters`` weights."""
    count = max(1, round(parameters / (WIDTH * WIDTH)))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(count))).to(device)


def step_times(millions: int, device: torch.device, level: str, repeats: int) -> tuple[float, float, float]:
    """Median seconds per step: (torch AdamW, amp8 unfused, amp8 fused at ``level``)."""
    torch.manual_seed(0)
    reference = square_layers(millions * 1_000_000, device)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-4, **fused)
    for param in reference.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    model = square_layers(millions * 1_000_000, device)
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), level, layer_selection="all"
    )
    fused_optimizer = LowBitAdam.from_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=True
    )
    unfused_optimizer = LowBitAdam.from_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=False
    )
    x = torch.randn(16, WIDTH, device=device)
    model(x).sum().backward()
    return (
        time_call(reference_optimizer.step, device, warmup=1, repeats=repeats),
        time_call(unfused_optimizer.step, device, warmup=1, repeats=repeats),
        time_call(fused_optimizer.step, device, warmup=2, repeats=repeats),
    )


class GptStack(nn.Module):
    """The parameter layout of a small GPT (d_model 256, 4 blocks, vocab 4096)."""

    def __init__(self, width: int = 256, blocks: int = 4, vocab: int = 4096) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "norm1": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width),
                "proj": nn.Linear(width, width), "norm2": nn.LayerNorm(width),
                "fc": nn.Linear(width, 4 * width), "out": nn.Linear(4 * width, width),
            })
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.embed(tokens)
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).chunk(3, dim=-1)
            x = x + block["proj"](nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            x = x + block["out"](nn.functional.gelu(block["fc"](block["norm2"](x))))
        return self.head(x)


def _byte_gpt(preset: str) -> nn.Module:
    from amp8.tools.experiments.gpt import GPT, PRESETS

    class Logits(nn.Module):  # the GPT returns (logits, loss); keep the logits
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT(PRESETS[preset])

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.gpt(tokens)[0]

    return Logits()


MODELS = {
    "byte GPT small": (lambda: _byte_gpt("small"), 256),
    "byte GPT medium": (lambda: _byte_gpt("medium"), 256),
    "GPT-style, vocab 4096": (GptStack, 4096),
}


def bytes_per_param(name: str, level: str, device: torch.device) -> dict[str, float]:
    """Bytes/param of model ``name`` after one AdamW step at ``level``, from the report."""
    torch.manual_seed(0)
    build, vocab = MODELS[name]
    model = build().to(device)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, layer_selection="all")
    tokens = torch.randint(0, vocab, (2, 64), device=device)
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()
    report = amp8.report(model, optimizer)
    return {"whole_model": report.bytes_per_param, "fp8_layers": report.fp8_bytes_per_param,
            "fp8_share": report.fp8_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 30], help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="time the step only, skip bytes/param")
    args = parser.parse_args()
    device = torch.device(args.device)
    console = default_console()

    timing_rows = []
    for millions in args.sizes:
        for level in ("O1", "O2", "O3"):
            torch_s, unfused_s, fused_s = step_times(millions, device, level, args.repeats)
            timing_rows.append({"millions": millions, "level": level, "torch_adamw_ms": 1e3 * torch_s,
                                "amp8_ms": 1e3 * unfused_s, "ratio": unfused_s / torch_s,
                                "amp8_fused_ms": 1e3 * fused_s, "fused_ratio": fused_s / torch_s,
                                "fused_speedup": unfused_s / fused_s})
    timing = Table(title="optimizer step: amp8 LowBitAdam (unfused, fused) vs torch AdamW")
    for column in ("params", "level", "torch AdamW ms", "amp8 ms", "amp8 fused ms", "amp8 / torch",
                   "fused / torch", "unfused / fused"):
        timing.add_column(column, justify="right")
    for row in timing_rows:
        timing.add_row(f"{row['millions']}M", row["level"], f"{row['torch_adamw_ms']:.1f}",
                       f"{row['amp8_ms']:.1f}", f"{row['amp8_fused_ms']:.1f}", f"{row['ratio']:.2f}x",
                       f"{row['fused_ratio']:.2f}x", f"{row['fused_speedup']:.2f}x")
    console.print(timing)

    if args.no_memory:
        path = write_result("optimizer", device, {"step_time": timing_rows})
        print(f"wrote {path}")
        return
    memory_rows = {
        name: {level: bytes_per_param(name, level, device) for level in amp8.LEVELS} for name in MODELS
    }
    memory = Table(title="bytes per parameter after one step (precision report)")
    for column in ("model", "level", "whole model", "FP8 layers", "FP8 share"):
        memory.add_column(column, justify="right")
    for name, levels in memory_rows.items():
        for level, row in levels.items():
            memory.add_row(name, level, f"{row['whole_model']:.2f}", f"{row['fp8_layers']:.2f}",
                           f"{100 * row['fp8_share']:.0f}%")
    console.print(memory)
    path = write_result("optimizer", device, {"step_time": timing_rows, "bytes_per_param": memory_rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
