"""Low-bit AdamW step time against torch's AdamW, and bytes/param per opt level.

    python bench/optimizer.py                        # CPU: 10M and 30M parameters
    python bench/optimizer.py --sizes 10 30 100      # millions of parameters
    python bench/optimizer.py --device cuda --sizes 300 1000 --widths 1024 4096 --fused-only --no-memory

Step time: one optimizer step over square FP8 layers (``--widths``: each layer width x
width) holding the given number of parameters, each step timed after an untimed
``zero_grad()`` and backward of its own, as training runs it (FP8 gradients land in the
update groups' buffers; the layers' casts are made again):
torch.optim.AdamW (foreach on the CPU, fused on CUDA) over FP32 layers of the same shapes,
and amp8's LowBitAdam at O1, O2 and O3 (``--levels``) with its torch.compile'd step (``fused=True``)
and, unless ``--fused-only``, its eager step (``fused=False``: the update groups run
eagerly), in the same process. Each row
starts from a fresh compiler: its first fused step compiles (``fused_first_step_s``;
``fused_compile_s`` is that less one timed step), outside the timing. Rows go width by
width, then size by size, then level by level, and the JSON is rewritten after each, so a
run cut short keeps what it measured. Bytes/param: the precision report after one
training step at each level, for amp8's byte-level GPT (presets small and medium; tied
head, so embeddings are a small share) and for a GPT-style stack with an untied
4096-entry vocabulary (embeddings 20 % of its parameters, which stay in FP32). Results
go to ``--out`` (bench/results/)/optimizer-<device>.json.
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
from common import free_memory, reset_compiler
from records import RESULTS, write_result
from timing import time_call, time_once

LEVELS = ("O1", "O2", "O3")


def square_layers(millions: int, width: int, device: torch.device) -> nn.Sequential:
    """Width x width linear layers, built on ``device``, holding about ``millions`` million weights."""
    count = max(1, round(millions * 1_000_000 / (width * width)))
    return nn.Sequential(*(nn.Linear(width, width, bias=False, device=device) for _ in range(count)))


def fill_gradients(layers: nn.Sequential, device: torch.device) -> None:
    """Give every layer a nonzero gradient of the same scale: each layer maps the same
    random input against the same random output gradient (a deep stack's gradients
    would vanish, and a step over zeros times nothing real)."""
    width = layers[0].in_features
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(16, width, device=device, generator=generator)
    grad = 1e-3 * torch.randn(16, width, device=device, generator=generator)
    sum((layer(x) * grad).sum() for layer in layers).backward()


def backward_pass(layers: nn.Sequential, optimizer: torch.optim.Optimizer, device: torch.device) -> Callable[[], None]:
    """What training runs before each step: ``zero_grad()``, then ``fill_gradients``' backward
    (FP8 gradients land in the update groups' buffers, the layers' casts are made again)."""
    def run() -> None:
        optimizer.zero_grad()
        fill_gradients(layers, device)
    return run


def step_row(millions: int, width: int, level: str, device: torch.device, repeats: int,
             reference_step: bool) -> dict[str, Any]:
    """One row: ms per step of torch AdamW and LowBitAdam at ``level`` (fused, and the
    eager step where ``reference_step``), their ratios and the fused compile seconds."""
    reset_compiler()
    free_memory(device)
    torch.manual_seed(0)
    reference = square_layers(millions, width, device)
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-4, **fast)
    torch_s = time_call(adamw.step, device, 1, repeats, before=backward_pass(reference, adamw, device))
    del reference, adamw
    free_memory(device)
    model = square_layers(millions, width, device)
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), level, layer_selection="all"
    )
    row: dict[str, Any] = {"millions": millions, "width": width, "layers": len(model),
                           "parameters": sum(p.numel() for p in model.parameters()), "level": level,
                           "torch_adamw_ms": 1e3 * torch_s}
    fused = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=True)
    backward = backward_pass(model, fused, device)
    backward()
    first_s, _ = time_once(fused.step, device)
    fused_s = time_call(fused.step, device, warmup=2, repeats=repeats, before=backward)
    row.update({"amp8_fused_ms": 1e3 * fused_s, "fused_ratio": fused_s / torch_s,
                "fused_first_step_s": first_s, "fused_compile_s": max(0.0, first_s - fused_s)})
    if reference_step:
        del fused
        free_memory(device)
        unfused = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=False)
        unfused_s = time_call(unfused.step, device, warmup=1, repeats=repeats, before=backward_pass(model, unfused, device))
        row.update({"amp8_ms": 1e3 * unfused_s, "ratio": unfused_s / torch_s, "fused_speedup": unfused_s / fused_s})
    return row


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


def print_timing(rows: list[dict[str, Any]]) -> None:
    """The step-time rows as a rich table."""
    timing = Table(title="optimizer step: amp8 LowBitAdam (fused, unfused) vs torch AdamW")
    for column in ("params", "width", "level", "torch AdamW ms", "amp8 fused ms", "fused / torch", "compile s",
                   "amp8 unfused ms", "unfused / torch", "unfused / fused"):
        timing.add_column(column, justify="right")
    for row in rows:
        unfused = ([f"{row['amp8_ms']:.1f}", f"{row['ratio']:.2f}x", f"{row['fused_speedup']:.2f}x"]
                   if "amp8_ms" in row else ["-"] * 3)
        timing.add_row(f"{row['millions']}M", str(row["width"]), row["level"], f"{row['torch_adamw_ms']:.1f}",
                       f"{row['amp8_fused_ms']:.1f}", f"{row['fused_ratio']:.2f}x",
                       f"{row['fused_compile_s']:.1f}", *unfused)
    default_console().print(timing)


def print_memory(memory_rows: dict[str, dict[str, dict[str, float]]]) -> None:
    """The bytes/param rows as a rich table."""
    memory = Table(title="bytes per parameter after one step (precision report)")
    for column in ("model", "level", "whole model", "FP8 layers", "FP8 share"):
        memory.add_column(column, justify="right")
    for name, levels in memory_rows.items():
        for level, row in levels.items():
            memory.add_row(name, level, f"{row['whole_model']:.2f}", f"{row['fp8_layers']:.2f}",
                           f"{100 * row['fp8_share']:.0f}%")
    default_console().print(memory)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 30], help="millions of parameters")
    parser.add_argument("--widths", type=int, nargs="+", default=[1024], help="width of the square layers")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS), help="opt levels to time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fused-only", action="store_true", help="skip amp8's reference (unfused) step")
    parser.add_argument("--no-memory", action="store_true", help="time the step only, skip bytes/param")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    for name in ("sizes", "widths"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name}={getattr(args, name)}: every value must be >= 1")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} is too small; use 1 or more")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; returns the path of the JSON written."""
    args = parse_args(argv)
    device = torch.device(args.device)
    payload: dict[str, Any] = {
        "torch_adamw": "fused" if device.type == "cuda" else "foreach", "repeats": args.repeats,
        "step_time": [],
    }
    for width in args.widths:
        for millions in args.sizes:
            for level in args.levels:
                payload["step_time"].append(step_row(millions, width, level, device, args.repeats, not args.fused_only))
                path = write_result("optimizer", device, payload, args.out)
                print(f"{millions}M x {width}, {level}: done", flush=True)
    print_timing(payload["step_time"])
    if not args.no_memory:
        payload["bytes_per_param"] = {
            name: {level: bytes_per_param(name, level, device) for level in amp8.LEVELS} for name in MODELS
        }
        print_memory(payload["bytes_per_param"])
        path = write_result("optimizer", device, payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
