"""An MLP on scikit-learn's 8x8 digits (an MNIST-like task that ships with scikit-learn),
trained at any opt level.

    python examples/mnist_like.py                       # O1, about 10 s on a laptop CPU
    python examples/mnist_like.py --opt-level O0 --epochs 5

The hidden layers (64 -> 256 -> 256) run in FP8 at O1 and above; the 10-way head has a
width FP8 cannot run, so amp8 keeps it in high precision and the report says so.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import amp8


@dataclass(frozen=True)
class Config:
    opt_level: str = "O1"
    hidden: int = 256
    epochs: int = 20
    batch_size: int = 64
    lr: float = 2e-3
    seed: int = 0


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden), nn.GELU(),  # (B, 64) -> (B, H), FP8
        nn.Linear(hidden, hidden), nn.GELU(),  # (B, H) -> (B, H), FP8
        nn.Linear(hidden, 10),  # (B, H) -> (B, 10), high precision: 10 is not a multiple of 16
    )


def train(config: Config = Config()) -> tuple[float, nn.Module, torch.optim.Optimizer]:
    """Train at ``config.opt_level``; returns (test accuracy, model, optimizer)."""
    digits = load_digits()
    images = torch.tensor(digits.data / 16.0, dtype=torch.float32)  # (N, 64)
    labels = torch.tensor(digits.target)  # (N,)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=config.seed, stratify=labels
    )
    torch.manual_seed(config.seed)
    model = mlp(config.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.epochs):
        for batch in torch.randperm(len(x_train), generator=generator).split(config.batch_size):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    return accuracy, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level, choices=list(amp8.LEVELS))
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    args = parser.parse_args()
    accuracy, model, optimizer = train(Config(opt_level=args.opt_level, epochs=args.epochs))
    print(f"{args.opt_level}: test accuracy {100 * accuracy:.1f}%")
    amp8.report(model, optimizer).print()


if __name__ == "__main__":
    main()
