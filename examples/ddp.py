"""Data-parallel training at any opt level, with FP8 gradients on the wire.

    torchrun --nproc_per_node 2 examples/ddp.py --opt-level O2      # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node 2 examples/ddp.py --opt-level O2 --no-ddp   # amp8's own averaging
    torchrun --nproc_per_node 2 examples/ddp.py --opt-level O3      # FP8 weights sharded by FSDP2

Each rank trains the same MLP regressor on its own slice of every batch. amp8.initialize,
called in every process after init_process_group, copies rank 0's weights to all ranks
and returns an optimizer that averages gradients over the ranks in FP8. At O0-O2 the model
then goes into DistributedDataParallel (apex's order), and at O1/O2 the DDP is handed to
amp8 with amp8.distributed.register_ddp: DDP averages the biases through amp8's FP8 comm
hook, amp8 the FP8 weight gradients. With --no-ddp amp8 averages every gradient itself.
At O3 amp8 applies FSDP2's fully_shard itself (each rank keeps only its rows of the FP8
weights and of their master weights and moments): do not wrap it in DDP. Rank 0 prints
the precision report (its own rows at O3).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import amp8


@dataclass(frozen=True)
class Config:
    width: int = 256
    steps: int = 100
    batch_size: int = 64  # per rank
    lr: float = 1e-3
    seed: int = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opt-level", default="O2", choices=list(amp8.LEVELS))
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--no-ddp", action="store_true", help="at O1/O2, let amp8 average every gradient")
    args = parser.parse_args()
    config = Config(steps=args.steps)

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(config.seed + rank)  # different initial weights: amp8 broadcasts rank 0's
    model = nn.Sequential(
        nn.Linear(64, config.width), nn.GELU(), nn.Linear(config.width, config.width), nn.GELU(),
        nn.Linear(config.width, 16),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=args.opt_level)
    wrap = world > 1 and (args.opt_level == "O0" or (args.opt_level != "O3" and not args.no_ddp))
    if wrap:  # O0 leaves data parallel to DDP; at O3 amp8 has applied FSDP2 itself
        model = nn.parallel.DistributedDataParallel(model)
        amp8.distributed.register_ddp(model)  # O1/O2: DDP and amp8 share the work (O0: nothing to do)

    target = torch.randn(64, 16, generator=torch.Generator().manual_seed(config.seed)).to(device)
    data = torch.Generator().manual_seed(config.seed + 1)
    for step in range(config.steps):
        x = torch.randn(world * config.batch_size, 64, generator=data).to(device)  # (B * world, 64)
        x = x[rank * config.batch_size : (rank + 1) * config.batch_size]  # this rank's slice
        optimizer.zero_grad()
        loss = (model(x) - torch.tanh(x @ target)).pow(2).mean()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    if rank == 0:
        shards = f" (rank 0's rows of the FP8 weights, 1/{world} of each)" if args.opt_level == "O3" else ""
        print(f"\nopt level {args.opt_level} on {world} ranks{shards}", flush=True)
        amp8.report(getattr(model, "module", model), optimizer).print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
