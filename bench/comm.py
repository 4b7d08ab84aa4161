"""Bytes on the wire and step time of gradient averaging: FP32 DDP, BF16 DDP, amp8 FP8.

    python bench/comm.py                    # two CPU processes over gloo on loopback
    python bench/comm.py --width 2048 --steps 20

Each mode trains the same MLP for a few steps on two processes. Bytes per step and rank
are counted from the tensors each rank hands to collectives, as the collectives'
algorithms move them (DDP's ring all-reduce: 2 (W-1)/W of each bucket; amp8: see
amp8.comm.WireStats), and, as a cross-check, read from the loopback interface's transmit
counter (TCP headers included, both ranks together, and any other loopback traffic on the
machine). Step time is the median over the timed steps. Results: bench/results/comm-cpu.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import amp8
from amp8.console import default_console
from common import write_result

LOOPBACK_TX = Path("/sys/class/net/lo/statistics/tx_bytes")
MODES = ("fp32_ddp", "bf16_ddp", "amp8_o1", "amp8_o2", "amp8_o3")


def _loopback_bytes() -> int | None:
    return int(LOOPBACK_TX.read_text()) if LOOPBACK_TX.exists() else None


def _counting_hook(compress: bool):
    """A DDP comm hook that counts each bucket's ring all-reduce bytes, then reduces it
    (in BF16 when ``compress``)."""
    def hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        world = dist.get_world_size()
        element = 2 if compress else bucket.buffer().element_size()
        state["bytes"] += 2 * (world - 1) * bucket.buffer().numel() * element // world
        if compress:
            return default_hooks.bf16_compress_hook(None, bucket)
        return default_hooks.allreduce_hook(None, bucket)
    return hook


def _worker(rank: int, world: int, folder: str, width: int, steps: int, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{mode}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = {"bytes": 0}
    if mode.endswith("ddp"):
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        model.register_comm_hook(counter, _counting_hook(compress=mode == "bf16_ddp"))
    else:
        model, optimizer = amp8.initialize(model, optimizer, opt_level=mode[-2:].upper())
    times, wire_before = [], None
    for step in range(steps + 2):
        if step == 2:  # two warm-up steps
            dist.barrier()
            counter["bytes"] = 0
            if not mode.endswith("ddp"):
                optimizer.data_parallel.stats.bytes_by_kind.clear()
            wire_before = _loopback_bytes()
        x = torch.randn(32, width, generator=torch.Generator().manual_seed(step * world + rank))
        start = time.perf_counter()
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    dist.barrier()
    wire_after = _loopback_bytes()
    sent = counter["bytes"] if mode.endswith("ddp") else optimizer.data_parallel.stats.total
    result = {
        "bytes_per_step": sent / steps,
        "loopback_bytes_per_step": None if wire_before is None else (wire_after - wire_before) / steps,
        "step_ms": 1e3 * statistics.median(times),
        "params": sum(p.numel() for p in model.parameters()),
    }
    torch.save(result, os.path.join(folder, f"{mode}-{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    world = 2
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            mp.start_processes(_worker, args=(world, folder, args.width, args.steps, mode), nprocs=world,
                               start_method="spawn")
            results[mode] = torch.load(os.path.join(folder, f"{mode}-0.pt"))
    base = results["fp32_ddp"]
    table = Table(title=f"gradient averaging, {world} CPU processes over gloo, {base['params']:,} parameters")
    for column in ("mode", "bytes/step/rank", "vs FP32 DDP", "vs BF16 DDP", "loopback bytes/step", "step ms", "time vs FP32 DDP"):
        table.add_column(column, justify="right")
    for mode, row in results.items():
        row["bytes_vs_fp32_ddp"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["bytes_vs_bf16_ddp"] = row["bytes_per_step"] / results["bf16_ddp"]["bytes_per_step"]
        row["time_vs_fp32_ddp"] = row["step_ms"] / base["step_ms"]
        loopback = row["loopback_bytes_per_step"]
        table.add_row(mode, f"{row['bytes_per_step']:,.0f}", f"{row['bytes_vs_fp32_ddp']:.3f}x",
                      f"{row['bytes_vs_bf16_ddp']:.3f}x", "-" if loopback is None else f"{loopback:,.0f}",
                      f"{row['step_ms']:.1f}", f"{row['time_vs_fp32_ddp']:.2f}x")
    default_console().print(table)
    print(f"wrote {write_result('comm', torch.device('cpu'), {'world': world, 'width': args.width, 'modes': results})}")


if __name__ == "__main__":
    main()
