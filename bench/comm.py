"""Bytes on the wire and step time of data parallel: FP32 DDP, BF16 DDP, FP32 FSDP2 and
amp8 (FP8 gradient averaging at O1/O2; at O3 also FSDP2's FP8 weight all-gathers).

    python bench/comm.py                    # two CPU processes over gloo on loopback
    python bench/comm.py --width 2048 --steps 20

Each mode trains the same MLP for a few steps on two processes. Bytes per step and rank
are counted from the tensors each rank hands to collectives, as the collectives'
algorithms move them (ring all-reduce: 2 (W-1)/W of the buffer; ring reduce-scatter:
(W-1)/W; all-gather: the shard to each other rank; amp8: see amp8.distributed.WireStats), and,
as a cross-check, read from the loopback interface's transmit counter (TCP headers
included, both ranks together, and any other loopback traffic on the machine). Step time
is the median over the timed steps; the reduction alone (FP32 and BF16 all-reduce against
amp8's FP8 all-reduce of one flat gradient of the model's size) is timed apart from the
FP8 GEMMs, with the SQNR of its mean. O3 compares with FP32 FSDP2 (both shard the weights
and gather them for forward and backward); O1/O2 with DDP. Results:
bench/results/comm-cpu.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import amp8
from amp8.distributed import WireStats, fp8_all_reduce_mean
from amp8.distributed.fsdp import ByteAllGather
from amp8.monitor.console import default_console
from amp8.quant.scaling import sqnr
from records import write_result
from timing import time_call

LOOPBACK_TX = Path("/sys/class/net/lo/statistics/tx_bytes")
MODES = ("fp32_ddp", "bf16_ddp", "fp32_fsdp", "amp8_o1", "amp8_o2", "amp8_o3")


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


class _CountingReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, counting what a ring reduce-scatter sends: (W-1)/W of the input."""

    def __init__(self, stats: WireStats) -> None:
        self.stats = stats

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = dist.get_world_size(group)
        self.stats.add("reduce_scatter", input_tensor.nbytes * (world - 1) // world)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _fully_shard_fp32(model: nn.Module, stats: WireStats) -> None:
    """FSDP2 on every Linear and the root, its collectives counted into ``stats``."""
    for module in [*(m for m in model.modules() if isinstance(m, nn.Linear)), model]:
        fully_shard(module)
        module.set_custom_all_gather(ByteAllGather(stats))
        module.set_custom_reduce_scatter(_CountingReduceScatter(stats))


def _worker(rank: int, world: int, folder: str, width: int, steps: int, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{mode}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = {"bytes": 0}
    stats = WireStats()
    if mode.endswith("ddp"):
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        model.register_comm_hook(counter, _counting_hook(compress=mode == "bf16_ddp"))
    elif mode == "fp32_fsdp":
        _fully_shard_fp32(model, stats)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # over the sharded Parameters
    else:
        model, optimizer = amp8.initialize(model, optimizer, opt_level=mode[-2:].upper())
        stats = optimizer.gradient_average.data_parallel.stats
    inputs = iter([torch.randn(32, width, generator=torch.Generator().manual_seed(step * world + rank))
                   for step in range(steps + 2)])

    def train_step() -> None:
        x = next(inputs)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    for _ in range(2):  # two warm-up steps, neither timed nor counted
        train_step()
    dist.barrier()
    counter["bytes"] = 0
    stats.bytes_by_kind.clear()
    wire_before = _loopback_bytes()
    step_s = time_call(train_step, torch.device("cpu"), warmup=0, repeats=steps)
    dist.barrier()
    wire_after = _loopback_bytes()
    sent = counter["bytes"] if mode.endswith("ddp") else stats.total
    by_kind = {"all_reduce": counter["bytes"]} if mode.endswith("ddp") else stats.bytes_by_kind
    result = {
        "bytes_per_step": sent / steps,
        "bytes_per_step_by_collective": {kind: count / steps for kind, count in by_kind.items()},
        "loopback_bytes_per_step": None if wire_before is None else (wire_after - wire_before) / steps,
        "step_ms": 1e3 * step_s,
        "params": sum(p.numel() for p in model.parameters()),
    }
    torch.save(result, os.path.join(folder, f"{mode}-{rank}.pt"))
    dist.destroy_process_group()


def _collective_worker(rank: int, world: int, folder: str, numel: int, repeats: int) -> None:
    """The gradient reduction alone, on one flat gradient of ``numel`` float32 values:
    FP32 and BF16 all-reduce against amp8's FP8 all-reduce; median times and the SQNR of
    amp8's mean against the FP32 all-reduce's."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-collective", rank=rank, world_size=world)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def fp32() -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total / world

    def bf16() -> torch.Tensor:
        total = grad.bfloat16()
        dist.all_reduce(total)
        return total.float() / world

    def fp8() -> torch.Tensor:
        return fp8_all_reduce_mean([grad])[0]

    result = {}
    for name, reduce in (("fp32_all_reduce", fp32), ("bf16_all_reduce", bf16), ("amp8_fp8_all_reduce", fp8)):
        seconds = time_call(reduce, torch.device("cpu"), warmup=1, repeats=repeats, before=dist.barrier)
        result[name] = {"ms": 1e3 * seconds, "mean": reduce()}  # once more, untimed, for its SQNR
    exact = result["fp32_all_reduce"].pop("mean")
    for name in ("bf16_all_reduce", "amp8_fp8_all_reduce"):
        result[name]["sqnr_db"] = sqnr(exact, result[name].pop("mean"))
    torch.save(result, os.path.join(folder, f"collective-{rank}.pt"))
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
        numel = results["fp32_ddp"]["params"]
        mp.start_processes(_collective_worker, args=(world, folder, numel, args.steps), nprocs=world,
                           start_method="spawn")
        collectives = torch.load(os.path.join(folder, "collective-0.pt"))
    base, base_fsdp = results["fp32_ddp"], results["fp32_fsdp"]
    table = Table(title=f"gradient averaging, {world} CPU processes over gloo, {base['params']:,} parameters")
    columns = ("mode", "bytes/step/rank", "vs FP32 DDP", "vs BF16 DDP", "vs FP32 FSDP2",
               "loopback bytes/step", "step ms", "time vs FP32 DDP", "time vs FP32 FSDP2")
    for column in columns:
        table.add_column(column, justify="right")
    for mode, row in results.items():
        row["bytes_vs_fp32_ddp"] = row["bytes_per_step"] / base["bytes_per_step"]
        row["bytes_vs_bf16_ddp"] = row["bytes_per_step"] / results["bf16_ddp"]["bytes_per_step"]
        row["bytes_vs_fp32_fsdp"] = row["bytes_per_step"] / base_fsdp["bytes_per_step"]
        row["time_vs_fp32_ddp"] = row["step_ms"] / base["step_ms"]
        row["time_vs_fp32_fsdp"] = row["step_ms"] / base_fsdp["step_ms"]
        loopback = row["loopback_bytes_per_step"]
        table.add_row(mode, f"{row['bytes_per_step']:,.0f}", f"{row['bytes_vs_fp32_ddp']:.3f}x",
                      f"{row['bytes_vs_bf16_ddp']:.3f}x", f"{row['bytes_vs_fp32_fsdp']:.3f}x",
                      "-" if loopback is None else f"{loopback:,.0f}",
                      f"{row['step_ms']:.1f}", f"{row['time_vs_fp32_ddp']:.2f}x", f"{row['time_vs_fp32_fsdp']:.2f}x")
    default_console().print(table)
    reduction = Table(title=f"the reduction alone: one gradient of {numel:,} float32 values, median of {args.steps}")
    for column in ("collective", "ms", "time vs FP32", "SQNR vs FP32 (dB)"):
        reduction.add_column(column, justify="right")
    for name, row in collectives.items():
        row["time_vs_fp32"] = row["ms"] / collectives["fp32_all_reduce"]["ms"]
        shown = "-" if "sqnr_db" not in row else f"{row['sqnr_db']:.1f}"
        reduction.add_row(name, f"{row['ms']:.1f}", f"{row['time_vs_fp32']:.2f}x", shown)
    default_console().print(reduction)
    print(f"wrote {write_result('comm', torch.device('cpu'), {'world': world, 'width': args.width, 'modes': results, 'reduction_alone': collectives})}")


if __name__ == "__main__":
    main()
