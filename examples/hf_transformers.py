"""A Hugging Face transformers model, built from a config (no download), under amp8.

    pip install "amp8[hf]"
    python examples/hf_transformers.py                  # O1, 20 steps, about 10 s on a laptop CPU
    python examples/hf_transformers.py --opt-level O0 --steps 50

A two-layer Llama with byte vocabulary trains on the standard library's sources. Its
projections (q, k, v, o, gate, up, down, lm_head) are nn.Linear with widths that are
multiples of 16, so amp8 runs all of them in FP8; the report shows it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import amp8
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch


@dataclass(frozen=True)
class Config:
    opt_level: str = "O1"
    steps: int = 20
    batch_size: int = 8
    block_size: int = 64
    lr: float = 1e-3
    seed: int = 0


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def train(
    config: Config = Config(), build: Callable[[], torch.nn.Module] = build_model
) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Train the causal LM ``build()`` gives a few steps; returns (losses, model, optimizer)."""
    torch.manual_seed(config.seed)
    corpus = load_corpus(CorpusConfig(max_bytes=256 * 1024))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    generator = torch.Generator().manual_seed(config.seed)
    losses = []
    for _ in range(config.steps):
        x, _ = sample_batch(corpus.train, config.batch_size, config.block_size, generator)  # (B, T)
        loss = model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level)
    parser.add_argument("--steps", type=int, default=Config.steps)
    args = parser.parse_args()
    losses, model, optimizer = train(Config(opt_level=args.opt_level, steps=args.steps))
    print(f"{args.opt_level}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    amp8.report(model, optimizer).print()


if __name__ == "__main__":
    main()
