"""A Hugging Face Llama trained by ``transformers.Trainer`` under amp8.

    pip install "amp8[hf]"
    python examples/hf_trainer.py                      # O2, 8 steps, a few seconds on a CPU
    python examples/hf_trainer.py --opt-level O1 --steps 20

The Trainer gets the model and the optimizer ``amp8.initialize`` returns, and a scheduler
built on that optimizer, through ``optimizers=(optimizer, scheduler)``. Its own gradient
clipping (``max_grad_norm``), accumulation and ``zero_grad`` see the FP8 weight gradients
in ``weight.grad``; the grad norm it logs includes them.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import amp8
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch


@dataclass(frozen=True)
class Config:
    opt_level: str = "O2"
    steps: int = 8
    batch_size: int = 4
    accumulation: int = 2
    block_size: int = 64
    lr: float = 2e-3
    max_grad_norm: float = 1.0
    seed: int = 0


def build_model() -> LlamaForCausalLM:
    """A two-layer Llama over bytes, built from a config (no download)."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def dataset(config: Config) -> list[dict[str, torch.Tensor]]:
    """Byte windows of the standard library's sources, one per micro-batch sample."""
    corpus = load_corpus(CorpusConfig(max_bytes=128 * 1024))
    samples = config.steps * config.accumulation * config.batch_size
    generator = torch.Generator().manual_seed(config.seed)
    x, _ = sample_batch(corpus.train, samples, config.block_size, generator)  # (samples, T)
    return [{"input_ids": row, "labels": row} for row in x.long()]  # the model shifts labels itself


def train(config: Config = Config()) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    """Train ``config.steps`` optimizer steps; returns (logged losses, model, optimizer)."""
    torch.manual_seed(config.seed)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    amp8.distributed.register_ddp_when_wrapped(model)  # under torchrun the Trainer wraps it in DDP
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))  # after initialize
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, use_cpu=True, save_strategy="no", report_to=[], seed=config.seed,
            per_device_train_batch_size=config.batch_size, gradient_accumulation_steps=config.accumulation,
            max_grad_norm=config.max_grad_norm, max_steps=config.steps, logging_steps=1, disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset(config), optimizers=(optimizer, scheduler))
        trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level, choices=list(amp8.LEVELS))
    parser.add_argument("--steps", type=int, default=Config.steps)
    args = parser.parse_args()
    losses, model, optimizer = train(Config(opt_level=args.opt_level, steps=args.steps))
    print(f"{args.opt_level}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    amp8.report(model, optimizer).print()


if __name__ == "__main__":
    main()
