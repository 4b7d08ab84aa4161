"""Train the byte-level GPT on the Python standard library's own sources at one opt level,
then sample from it.

    python examples/gpt.py                              # O1, 300 steps, about a minute on a laptop CPU
    python examples/gpt.py --opt-level O0 --steps 1000
    python examples/gpt.py --device cuda --n-layer 6 --n-embd 384 --block-size 256 --steps 5000

`amp8 compare` runs the same model at every level side by side; this is the plain loop.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

import torch

import amp8
from amp8.tools.experiments.corpus import load_corpus, sample_batch
from amp8.tools.experiments.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class Config:
    opt_level: str = "O1"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128  # a multiple of 16, so every projection runs in FP8
    block_size: int = 64
    batch_size: int = 16
    steps: int = 300
    lr: float = 1e-3
    eval_every: int = 100
    device: str = "cpu"
    seed: int = 0


def train(config: Config = Config()) -> tuple[float, GPT]:
    """Train; returns (final validation loss in nats/byte, model)."""
    corpus = load_corpus()
    shape = GPTConfig(config.n_layer, config.n_head, config.n_embd, config.block_size)
    model = GPT(shape, torch.Generator().manual_seed(config.seed)).to(config.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    generator = torch.Generator().manual_seed(config.seed)

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        batches = [sample_batch(corpus.val, config.batch_size, config.block_size, torch.Generator().manual_seed(k))
                   for k in range(8)]
        loss = sum(model(x.to(config.device), y.to(config.device))[1].item() for x, y in batches) / len(batches)
        model.train()
        return loss

    for step in range(config.steps):
        lr = config.lr * 0.5 * (1 + math.cos(math.pi * step / config.steps))  # cosine decay
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sample_batch(corpus.train, config.batch_size, config.block_size, generator)  # (B, T), (B, T)
        _, loss = model(x.to(config.device), y.to(config.device))  # logits (B, T, 256), loss ()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % config.eval_every == 0:
            print(f"step {step + 1}: train {loss.item():.3f}, val {val_loss():.3f} nats/byte")
    return val_loss(), model


@torch.no_grad()
def sample(model: GPT, prompt: bytes, length: int, seed: int = 0) -> bytes:
    """Continue ``prompt`` by ``length`` bytes, sampling from the model."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt)], device=device)  # (1, T)
    for _ in range(length):
        logits, _ = model(idx[:, -model.config.block_size:])  # (1, T, 256)
        probs = torch.softmax(logits[:, -1].float(), dim=-1)  # (1, 256)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)  # (1, T + 1)
    return bytes(idx[0].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in fields(Config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    config = Config(**vars(parser.parse_args()))
    loss, model = train(config)
    print(f"{config.opt_level}: final validation loss {loss:.4f} nats/byte")
    print(sample(model, b"def ", 200).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
