"""An MLP trained with Hugging Face Accelerate under amp8, in one process or several.

    python examples/accelerate_train.py                              # O2, one process, about 2 s
    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py --opt-level O1

``amp8.initialize`` comes first (in every process: ``accelerate launch`` has set up the
process group by the time ``Accelerator()`` is built), then ``accelerator.prepare``, which
wraps the model in ``DistributedDataParallel`` when there are several processes, then
``amp8.distributed.register_ddp`` on that DDP. DDP averages the biases (with amp8's FP8
comm hook); amp8 averages the FP8 weight gradients, FP8 on the wire, by the end of each
synchronizing backward, so ``accelerator.clip_grad_norm_`` sees averaged gradients.
O3 shards weights with FSDP2 inside amp8 and is not for a DDP wrapper: use O0-O2 here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn

import amp8


@dataclass(frozen=True)
class Config:
    opt_level: str = "O2"
    epochs: int = 4
    samples: int = 256
    batch_size: int = 16
    accumulation: int = 2
    lr: float = 1e-2
    max_grad_norm: float = 1.0
    seed: int = 0


def data(config: Config) -> torch.utils.data.TensorDataset:
    """A learnable regression: targets from a fixed random map of the inputs."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(config.samples, 64, generator=generator)  # (S, 64)
    target = torch.tanh(x @ torch.randn(64, 32, generator=generator) / 8)  # (S, 32)
    return torch.utils.data.TensorDataset(x, target)


def train(config: Config = Config()) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    """Train; returns (mean loss per epoch, the unwrapped model, the amp8 optimizer)."""
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))  # both FP8 at O1-O3
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=config.opt_level)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=config.accumulation)
    loader = torch.utils.data.DataLoader(data(config), batch_size=config.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if isinstance(model, nn.parallel.DistributedDataParallel):  # several processes
        amp8.distributed.register_ddp(model)
    epoch_losses = []
    for _ in range(config.epochs):
        total, batches = 0.0, 0
        for x, target in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), target)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            total, batches = total + loss.item(), batches + 1
        epoch_losses.append(total / batches)
    return epoch_losses, accelerator.unwrap_model(model), optimizer.optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default=Config.opt_level, choices=["O0", "O1", "O2"])
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    args = parser.parse_args()
    losses, model, optimizer = train(Config(opt_level=args.opt_level, epochs=args.epochs))
    print(f"{args.opt_level}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} epochs")


if __name__ == "__main__":
    main()
