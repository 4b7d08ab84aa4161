"""LoRA fine-tuning (Hugging Face PEFT) of a small Llama on an FP8 base.

    pip install "amp8[hf]" peft
    python examples/lora_finetune.py                      # O3, 30 steps, about 15 s on 2 CPU cores
    python examples/lora_finetune.py --opt-level O1 --order lora-first

The base's projections become amp8 ``Fp8Linear`` layers and are frozen: at O3 they hold
one byte per parameter plus a float32 scale per row, with no gradient and no optimizer
state. The LoRA adapters (``lora_A``, ``lora_B``) stay in float32 and train. Either order
works: ``amp8.initialize`` then ``get_peft_model`` (the config passed through
``amp8.nn.register_lora``), or ``get_peft_model`` then ``amp8.initialize``. At the end
``amp8.export`` gives the base back in float32 and PEFT's ``merge_and_unload`` merges.
In practice the base is a pretrained checkpoint; here it is built from a config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import amp8
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch

ORDERS = ("amp8-first", "lora-first")


@dataclass(frozen=True)
class Config:
    opt_level: str = "O3"
    order: str = "amp8-first"
    steps: int = 30
    batch_size: int = 8
    block_size: int = 64
    rank: int = 8
    lr: float = 3e-3
    seed: int = 0


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def lora_config(rank: int) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


def prepare(config: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The LoRA model on an amp8 base, and its optimizer (over the adapters only)."""
    if config.order not in ORDERS:
        raise ValueError(f"order={config.order!r} is not one of {ORDERS}")
    model = build_model()
    if config.order == "amp8-first":
        model, _ = amp8.initialize(model, None, opt_level=config.opt_level)
        model = get_peft_model(model, amp8.nn.register_lora(lora_config(config.rank)))
        # The adapters are plain float32 Parameters: any optimizer steps them.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
        return model, optimizer
    model = get_peft_model(model, lora_config(config.rank))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    return amp8.initialize(model, optimizer, opt_level=config.opt_level)  # type: ignore[return-value]


def train(config: Config = Config()) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Fine-tune the adapters a few steps; returns (losses, model, optimizer)."""
    torch.manual_seed(config.seed)
    corpus = load_corpus(CorpusConfig(max_bytes=256 * 1024))
    model, optimizer = prepare(config)
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
    parser.add_argument("--order", default=Config.order, choices=ORDERS)
    parser.add_argument("--steps", type=int, default=Config.steps)
    args = parser.parse_args()
    config = Config(opt_level=args.opt_level, order=args.order, steps=args.steps)
    losses, model, optimizer = train(config)
    report = amp8.report(model, optimizer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{config.opt_level}, {config.order}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    print(f"bytes per frozen base parameter: {report.frozen_bytes_per_param(fp8_layers_only=True):.3f} in FP8 "
          f"layers, {report.frozen_bytes_per_param():.3f} over the whole frozen base (bf16: 2)")
    print(f"trainable (adapter) parameters: {trainable:,}")
    merged = amp8.export(model).merge_and_unload()  # a plain transformers model
    print(f"exported and merged: {type(merged).__name__}, {type(merged.model.layers[0].self_attn.q_proj).__name__} q_proj")


if __name__ == "__main__":
    main()
