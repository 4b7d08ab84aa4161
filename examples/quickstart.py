"""Train a small token-mixing classifier on scikit-learn's digits at O0 and O1, then
print amp8's precision report of the O1 model.

    python examples/quickstart.py                 # O0 vs O1, about 15 s on a laptop CPU
    python examples/quickstart.py --levels O1 --epochs 5

Each 8x8 digit is read as 8 tokens of 8 pixels, so the linear layers see (B, T, C)
inputs as in a transformer. The embedding (8 -> 64) and the head (64 -> 10) have widths
FP8 cannot run; the report says so, and amp8 keeps them in high precision.
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
    width: int = 64
    hidden: int = 256
    blocks: int = 2
    epochs: int = 30
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0


class MixerBlock(nn.Module):
    """Pre-norm residual MLP over the channels of each token."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class DigitsClassifier(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = nn.Linear(8, config.width)  # 8 pixels per token: stays high precision
        self.position = nn.Parameter(torch.zeros(8, config.width))
        self.blocks = nn.Sequential(*(MixerBlock(config.width, config.hidden) for _ in range(config.blocks)))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, 10)  # 10 classes: stays high precision

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 8, 8)
        x = self.embed(images) + self.position  # (B, T, C)
        x = self.norm(self.blocks(x)).mean(dim=1)  # (B, C)
        return self.head(x)  # (B, 10)


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """Digits scaled to [0, 1] as (N, 8, 8), split 80/20 with a fixed seed."""
    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=seed, stratify=labels
    )
    return x_train, x_test, y_train, y_test


def train(
    opt_level: str, config: Config = Config(), recipe_scaling: str = "current"
) -> tuple[float, nn.Module, torch.optim.Optimizer]:
    """Train at ``opt_level``; returns (test accuracy, model, optimizer)."""
    torch.manual_seed(config.seed)
    x_train, x_test, y_train, y_test = load_data(config.seed)
    model = DigitsClassifier(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    recipe = amp8.Recipe(scaling=recipe_scaling)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=opt_level, recipe=recipe)
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(config.epochs):
        model.train()
        for batch in torch.randperm(len(x_train), generator=generator).split(config.batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    return accuracy, model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", default=["O0", "O1"], help="opt levels to train")
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    args = parser.parse_args()
    config = Config(epochs=args.epochs)
    model = optimizer = None
    for level in args.levels:
        accuracy, model, optimizer = train(level, config)
        print(f"{level}: test accuracy {100 * accuracy:.1f}%")
    amp8.report(model, optimizer).print()


if __name__ == "__main__":
    main()
