"""Train a small mixture of experts (transformers' Mixtral) with FP8 experts.

    pip install "amp8[hf]"
    python examples/moe.py                  # O2, 40 steps, about 20 s on 2 CPU cores
    python examples/moe.py --opt-level O3 --steps 100

``amp8.initialize`` swaps every ``MixtralExperts`` (8 experts of two 3-D Parameters) for an
``amp8.nn.Fp8Experts``: all six GEMMs of both projections run in FP8, grouped by expert,
with each expert's own scales. At O1/O2 the expert weights are stored in FP16 with a
scale, at O3 in FP8 beside the optimizer's FP16 master; their gradients are FP8, and
``LowBitAdam`` keeps FP8 first moments with a scale per row. The router stays in high
precision. The training loop is examples/hf_transformers.py's. At the end the example
prints the precision report, whose summary gives the bytes per parameter of the whole
model, and exports the plain Mixtral back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import amp8
import hf_transformers


@dataclass(frozen=True)
class Config(hf_transformers.Config):
    opt_level: str = "O2"
    steps: int = 40
    lr: float = 2e-3


def build_model() -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    )
    return MixtralForCausalLM(config)


def train(config: Config = Config()) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Train the byte-level Mixtral a few steps; returns (losses, model, optimizer)."""
    return hf_transformers.train(config, build_model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default=Config.opt_level, choices=["O1", "O2", "O3"])
    parser.add_argument("--steps", type=int, default=Config.steps)
    args = parser.parse_args()
    losses, model, optimizer = train(Config(opt_level=args.opt_level, steps=args.steps))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    print(f"model.model.layers[0].mlp.experts: {model.model.layers[0].mlp.experts}")
    amp8.report(model, optimizer).print()
    exported = amp8.export(model, optimizer)
    print(f"exported experts: {type(exported.model.layers[0].mlp.experts).__name__}")


if __name__ == "__main__":
    main()
