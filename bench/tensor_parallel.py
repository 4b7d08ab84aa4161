"""Tensor parallel with sequence parallelism: bytes on the wire per step against BF16
tensor parallel, and the SQNR of the sharded run against one process.

    OMP_NUM_THREADS=1 python bench/tensor_parallel.py            # two CPU processes over gloo
    OMP_NUM_THREADS=1 python bench/tensor_parallel.py --hidden 1024 --seq 512

One MLP block (Linear(H, 4H), GELU, Linear(4H, H)) runs column-parallel then
row-parallel on two ranks with the sequence sharded between blocks: the input is
all-gathered before the first layer (in FP8 for amp8, in BF16 for the baseline) and the
output reduce-scattered after the second. Bytes per step and rank are those each rank
hands to collectives, as ring algorithms move them (``amp8.distributed.WireStats``), by
collective; activations and their gradients are BF16 in every mode. SQNR (dB) of the
output, the input gradient and the first weight's gradient against an FP32 run in one
process, and against amp8's own run in one process.
Results: bench/results/tensor-parallel-cpu.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

import amp8
from amp8.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, WireStats
from amp8.monitor.console import default_console
from amp8.quant.scaling import sqnr
from records import write_result

WORLD = 2
MODES: dict[str, tuple[str | None, Any]] = {
    "bf16_tp": (None, None),
    "amp8_o1_rowwise": ("O1", lambda: amp8.Recipe.preset("rowwise")),
    "amp8_o2_rowwise": ("O2", lambda: amp8.Recipe.preset("rowwise")),
    "amp8_o2_tensorwise": ("O2", amp8.Recipe),
}


def _block(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def _model(mode: str, hidden: int, group: dist.ProcessGroup) -> nn.Module:
    level, recipe = MODES[mode]
    if level is None:
        return _block(hidden).to(torch.bfloat16)
    model, _ = amp8.initialize(_block(hidden), None, level, recipe=recipe(), process_group=group,
                               layer_selection="all")
    return model


def _data(hidden: int, seq: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(batch, seq, hidden, generator=generator),
            torch.randn(batch, seq, hidden, generator=generator))


def _run(model: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Forward and backward with activations in ``dtype`` (BF16: every mode's activations
    and gradients move in BF16 but for amp8's FP8 gather)."""
    x = x.detach().to(dtype).clone().requires_grad_(True)
    y = model(x)
    (y * g.to(y.dtype)).sum().backward()
    first = model[0]
    weight_grad = first.weight_grad.dequantize() if getattr(first, "weight_grad", None) is not None else first.weight.grad
    return {"y": y.detach().float(), "x_grad": x.grad.float(), "w0_grad": weight_grad.float()}


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(pieces, t.contiguous())
    return torch.cat(pieces, dim)


def _worker(rank: int, folder: str, mode: str, hidden: int, seq: int, batch: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store-{mode}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    stats = WireStats()
    plan = {"0": Fp8ColwiseParallel(input_layouts=Shard(1), wire_stats=stats),
            "2": Fp8RowwiseParallel(output_layouts=Shard(1), wire_stats=stats)}
    model = parallelize_module(_model(mode, hidden, mesh["dp"].get_group()), mesh["tp"], plan)
    x, g = _data(hidden, seq, batch)
    local = _run(model, x.chunk(WORLD, 1)[rank], g.chunk(WORLD, 1)[rank])
    for _ in range(steps - 1):
        model.zero_grad()
        _run(model, x.chunk(WORLD, 1)[rank], g.chunk(WORLD, 1)[rank])
    whole = {"y": _gathered(local["y"], 1), "x_grad": _gathered(local["x_grad"], 1),
             "w0_grad": _gathered(local["w0_grad"], 0)}
    if rank == 0:
        fp32 = _run(_block(hidden), x, g, torch.float32)
        single = _run(_model(mode, hidden, mesh["dp"].get_group()), x, g)
        result = {
            "bytes_per_step": {kind: count // steps for kind, count in stats.bytes_by_kind.items()},
            "sqnr_vs_fp32": {key: round(sqnr(fp32[key], whole[key]), 2) for key in whole},
            "sqnr_vs_one_process": {key: round(min(sqnr(single[key], whole[key]), 200.0), 2) for key in whole},
            "one_process_sqnr_vs_fp32": {key: round(sqnr(fp32[key], single[key]), 2) for key in whole},
        }
        torch.save(result, os.path.join(folder, f"{mode}.pt"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            mp.start_processes(_worker, args=(folder, mode, args.hidden, args.seq, args.batch, args.steps),
                               nprocs=WORLD, start_method="spawn")
            results[mode] = torch.load(os.path.join(folder, f"{mode}.pt"))
    base = results["bf16_tp"]["bytes_per_step"]
    table = Table(title=f"sequence-parallel MLP block, {WORLD} CPU processes over gloo, hidden {args.hidden}")
    for column in ("mode", "gather bytes", "vs BF16", "all bytes", "vs BF16", "y dB", "x grad dB", "w grad dB"):
        table.add_column(column)
    for mode, result in results.items():
        counts = result["bytes_per_step"]
        result["sequence_gather_vs_bf16"] = round(counts["all_gather_sequence"] / base["all_gather_sequence"], 4)
        result["all_bytes_vs_bf16"] = round(sum(counts.values()) / sum(base.values()), 4)
        dbs = result["sqnr_vs_fp32"]
        table.add_row(mode, f"{counts['all_gather_sequence']:,}", f"{result['sequence_gather_vs_bf16']:.3f}x",
                      f"{sum(counts.values()):,}", f"{result['all_bytes_vs_bf16']:.3f}x",
                      f"{dbs['y']:.1f}", f"{dbs['x_grad']:.1f}", f"{dbs['w0_grad']:.1f}")
    default_console().print(table)
    config = {"world": WORLD, "hidden": args.hidden, "ffn": 4 * args.hidden, "seq": args.seq,
              "batch": args.batch, "steps": args.steps}
    path = write_result("tensor-parallel", torch.device("cpu"), {"config": config, "modes": results})
    default_console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
