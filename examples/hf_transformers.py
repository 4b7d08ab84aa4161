"""A Hugging Face transformers model, built from a config (no download), under amp8.

    pip install "amp8[hf]"
    python examples/hf_transformers.py                  # O1, 20 steps, about 10 s on a laptop CPU
    python examples/hf_transformers.py --opt-level O0 --steps 50
    python examples/hf_transformers.py --layers 32 --opt-level O2 --steps 3   # the report of 32 blocks
    python examples/hf_transformers.py --layers 32 --opt-level O2 --steps 3 --png docs/report.png
    python examples/hf_transformers.py --layers 32 --opt-level O2 --steps 3 --what-if

A two-layer Llama with byte vocabulary trains on the standard library's sources. Its
projections (q, k, v, o, gate, up, down, lm_head) are nn.Linear with widths that are
multiples of 16, so amp8 runs all of them in FP8; the report shows it (with repeated
blocks folded into one row per role from three blocks on; ``--full`` prints every tensor).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import amp8
from amp8.monitor.console import default_console
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch


@dataclass(frozen=True)
class Config:
    opt_level: str = "O1"
    steps: int = 20
    batch_size: int = 8
    block_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    layers: int = 2


def build_model(layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def train(
    config: Config = Config(), build: Callable[[], torch.nn.Module] | None = None
) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Train the causal LM ``build()`` gives (a Llama of ``config.layers`` blocks by
    default) a few steps; returns (losses, model, optimizer)."""
    torch.manual_seed(config.seed)
    corpus = load_corpus(CorpusConfig(max_bytes=256 * 1024))
    model = build() if build is not None else build_model(config.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    generator = torch.Generator().manual_seed(config.seed)
    losses = []
    for step in range(config.steps):
        x, _ = sample_batch(corpus.train, config.batch_size, config.block_size, generator)  # (B, T)
        # The last step's casts are watched, so the report shows each GEMM operand's health.
        with amp8.watch_operands(model) if step == config.steps - 1 else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model, optimizer


def what_if_step(model: torch.nn.Module, config: Config = Config()) -> amp8.monitor.WhatIf:
    """One forward and backward (no optimizer step) inside ``amp8.what_if``: the SQNR each
    FP8 layer's casts would get under each recipe."""
    corpus = load_corpus(CorpusConfig(max_bytes=256 * 1024))
    x, _ = sample_batch(corpus.train, config.batch_size, config.block_size, torch.Generator().manual_seed(config.seed))
    with amp8.what_if(model) as found:
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--layers", type=int, default=Config.layers, help="the Llama's blocks")
    parser.add_argument("--full", action="store_true", help="the report's every tensor, blocks not folded")
    parser.add_argument("--png", help="also draw the report as a heatmap into this PNG (needs matplotlib)")
    parser.add_argument("--what-if", action="store_true", help="what each layer's casts would give under each recipe")
    args = parser.parse_args()
    losses, model, optimizer = train(Config(opt_level=args.opt_level, steps=args.steps, layers=args.layers))
    print(f"{args.opt_level}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    precision = amp8.report(model, optimizer)
    precision.print(full=args.full)
    if args.png:
        print(f"wrote {precision.plot(args.png)}")
    if args.what_if:
        what_if_step(model, Config(layers=args.layers)).print(default_console())


if __name__ == "__main__":
    main()
