"""An MLP trained by Lightning's ``Trainer`` under amp8.

    python examples/lightning_train.py                       # O2, a few seconds on a CPU
    python examples/lightning_train.py --opt-level O1 --max-steps 100

The LightningModule calls ``amp8.initialize`` on its network in ``__init__`` and returns
the optimizer amp8 built from ``configure_optimizers``. Lightning's gradient clipping
(``gradient_clip_val``), accumulation (``accumulate_grad_batches``) and ``zero_grad``
handle the FP8 weight gradients in ``weight.grad`` as any other gradient: no plugin.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import lightning
import torch
from torch import nn

import amp8


@dataclass(frozen=True)
class Config:
    opt_level: str = "O2"
    max_steps: int = 40
    samples: int = 256
    batch_size: int = 16
    accumulation: int = 2
    lr: float = 1e-2
    gradient_clip_val: float = 1.0
    seed: int = 0


class Regressor(lightning.LightningModule):
    """A two-layer MLP (both layers FP8 at O1-O3) fitting a fixed random map."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
        optimizer = torch.optim.AdamW(net.parameters(), lr=config.lr)
        self.net, self.amp8_optimizer = amp8.initialize(net, optimizer, opt_level=config.opt_level)
        amp8.distributed.register_ddp_when_wrapped(self)  # Lightning's DDP strategy wraps this module

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        x, target = batch  # (B, 64), (B, 32)
        loss = nn.functional.mse_loss(self.net(x), target)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.amp8_optimizer


def data(config: Config) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(config.samples, 64, generator=generator)  # (S, 64)
    target = torch.tanh(x @ torch.randn(64, 32, generator=generator) / 8)  # (S, 32)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, target), batch_size=config.batch_size)


def loss_on_all(module: Regressor, loader: torch.utils.data.DataLoader) -> float:
    """Mean squared error over every sample."""
    x, target = loader.dataset.tensors
    with torch.no_grad():
        return nn.functional.mse_loss(module.net(x), target).item()


def train(config: Config = Config()) -> tuple[float, float, Regressor]:
    """Train; returns (loss before, loss after, the module)."""
    torch.manual_seed(config.seed)
    module = Regressor(config)
    loader = data(config)
    before = loss_on_all(module, loader)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=config.max_steps, gradient_clip_val=config.gradient_clip_val,
        accumulate_grad_batches=config.accumulation, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return before, loss_on_all(module, loader), module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level, choices=list(amp8.LEVELS))
    parser.add_argument("--max-steps", type=int, default=Config.max_steps)
    args = parser.parse_args()
    before, after, module = train(Config(opt_level=args.opt_level, max_steps=args.max_steps))
    print(f"{args.opt_level}: loss {before:.4f} -> {after:.4f} after {args.max_steps} steps")
    amp8.report(module.net, module.amp8_optimizer).print()


if __name__ == "__main__":
    main()
