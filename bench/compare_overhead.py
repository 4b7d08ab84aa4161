"""What ``amp8.compare(model=..., data=...)`` costs beyond training its levels.

    OMP_NUM_THREADS=1 python bench/compare_overhead.py            # an MLP, 200 steps, O0-O3, one seed
    python bench/compare_overhead.py --steps 50 --width 256 --no-plot

One call of the user-model comparison on a regression MLP of ``--width`` (batches of 64),
with validation data, JSON and (unless ``--no-plot``) the PNG: its wall time against the
sum of its runs' wall times (each run: the copy of the model, ``amp8.initialize``, the
steps, the evaluations and the precision report) and against the sum of the time inside
the training steps alone. The target is a total within 1.1x of the runs' sum at one
seed. Results go to ``--out``/compare_overhead-<device>.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amp8
from records import RESULTS, write_result
from timing import time_once


def build(width: int) -> nn.Module:
    """The MLP: 64 inputs, three hidden Linear layers of ``width``, one output."""
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of 64 samples of a noisy linear target."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(64, 1, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(count):
        x = torch.randn(64, 64, generator=generator)
        out.append((x, x @ weights + 0.1 * torch.randn(64, 1, generator=generator)))
    return out


def measure(steps: int, width: int, plot: bool, device: str) -> dict[str, Any]:
    """One comparison's total wall time, its runs' wall times and their training time."""
    data, val = batches(steps, 0), batches(4, 1)
    with tempfile.TemporaryDirectory() as out:
        total, result = time_once(lambda: amp8.compare(
            model=lambda: build(width), data=data, eval_data=val, steps=steps, device=device,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            loss=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
            out_dir=Path(out), progress=False, plot=plot,
        ), torch.device(device))
    runs = sum(run.wall_s or 0.0 for run in result.runs)
    train = sum(run.train_s or 0.0 for run in result.runs)
    return {
        "steps": steps, "width": width, "plot": plot, "levels": [run.name for run in result.runs],
        "total_s": total, "runs_s": runs, "train_s": train,
        "total_over_runs": total / runs, "total_over_train": total / train,
        "per_run_s": {run.name: run.wall_s for run in result.runs},
        "recommended": result.recommended.level,
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-plot", action="store_true", help="leave the PNG out of the total")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    record = measure(args.steps, args.width, not args.no_plot, args.device)
    print(f"total {record['total_s']:.2f} s; runs {record['runs_s']:.2f} s (x{record['total_over_runs']:.3f}); "
          f"inside steps {record['train_s']:.2f} s (x{record['total_over_train']:.3f}); "
          f"recommended {record['recommended']}")
    path = write_result("compare_overhead", torch.device(args.device), record, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
