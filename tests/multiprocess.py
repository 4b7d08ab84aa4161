"""Run a function on several CPU processes joined by gloo, the way the tests need it."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


import amp8

TIMEOUT_S = 180


def _entry(rank: int, fn: Callable[..., Any], world: int, folder: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(folder, f"result-{rank}.pt"))
        del result
        dist.barrier()  # no rank tears its group down while another still has collectives in flight
    finally:
        # DDP's reducer must go before its process group: collect the reference cycles
        # (hooks that point back at their DDP) that would otherwise outlive it.
        gc.collect()
        dist.destroy_process_group()


def run(
    fn: Callable[..., Any], folder: Path, *args: Any, world: int = 2, timeout_s: float = TIMEOUT_S
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; their return values.

    ``fn`` must be a module-level function. Fails if a process fails or the run takes
    longer than ``timeout_s`` seconds (a hang is killed then).
    """
    context = mp.start_processes(
        _entry, args=(fn, world, str(folder), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{fn.__name__} did not finish in {timeout_s} s")
    return [torch.load(folder / f"result-{rank}.pt", weights_only=False) for rank in range(world)]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` in its compact form (the weights as stored) with every
    DTensor (a weight sharded over the ranks) gathered whole on every rank, moved as bytes
    (gloo has no FP8 dtype); call it on every rank."""
    state = {}
    with amp8.compact_state_dict(model):
        saved = model.state_dict()
    for key, value in saved.items():
        to_local = getattr(value, "to_local", None)
        if to_local is not None:
            local = to_local()
            world = dist.get_world_size()
            rows = -(-value.shape[0] // world)
            padded = local.new_zeros((rows, *value.shape[1:]))
            padded[: local.shape[0]] = local
            pieces = [torch.empty_like(padded.view(torch.uint8)) for _ in range(world)]
            dist.all_gather(pieces, padded.view(torch.uint8))
            value = torch.cat(pieces)[: value.shape[0]].view(local.dtype)
        state[key] = value.detach().clone()
    return state
