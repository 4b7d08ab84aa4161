"""What watching FP8 casts costs: GPT training steps with and without ``amp8.Controller``.

    OMP_NUM_THREADS=1 python bench/controller.py                  # CPU, GPT "small", eager and compiled
    python bench/controller.py --preset tiny --steps 4 --rounds 1   # smoke run

Runs, from the same initial weights on the same batches, O1 (tensorwise):
- off: no controller;
- default: ``amp8.Controller()``: one step in 10 is watched;
- every step: ``ControllerConfig(interval=1)``: every cast writes its health signals.
Each in eager mode and under ``torch.compile(model)`` (the compiled runs take a second
graph for the watched steps). Rounds alternate the runs, so drift in the machine's speed
reaches them alike; each round times ``--steps`` steps per run after a warm-up that
covers the compilation of both graphs. The step time is the median over rounds of the
mean step time of a round, and the cost of a run is its ratio to "off" minus one.
No layer moves on this data (the report says how many moves each run made). Results go
to ``--out``/controller-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

import amp8
from amp8.monitor.console import default_console
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch
from amp8.tools.experiments.gpt import GPT, PRESETS
from records import RESULTS, write_result
from timing import time_once

VARIANTS: dict[str, amp8.ControllerConfig | None] = {
    "off": None,
    "default": amp8.ControllerConfig(),
    "every step": amp8.ControllerConfig(interval=1),
}


def _build(preset: str, config: amp8.ControllerConfig | None, compiled: bool, device: torch.device) -> dict[str, Any]:
    model = GPT(PRESETS[preset], torch.Generator().manual_seed(0)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = None if config is None else amp8.Controller(config)
    model, optimizer = amp8.initialize(model, optimizer, "O1", layer_selection="all", controller=controller)
    return {"model": torch.compile(model) if compiled else model, "optimizer": optimizer, "controller": controller}


def _steps(run: dict[str, Any], batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean seconds per training step over ``batches``."""
    model, optimizer = run["model"], run["optimizer"]

    def train() -> None:
        for x, y in batches:
            optimizer.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()

    seconds, _ = time_once(train, device)
    return seconds / len(batches)


def measure(preset: str, batch_size: int, steps: int, rounds: int, compiled: bool, device: torch.device) -> dict[str, Any]:
    """Step times of every variant, compiled or eager (see the module docstring)."""
    corpus = load_corpus(CorpusConfig())
    generator = torch.Generator().manual_seed(0)
    block = PRESETS[preset].block_size

    def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(t.to(device) for t in sample_batch(corpus.train, batch_size, block, generator))
                for _ in range(count)]

    runs = {name: _build(preset, config, compiled, device) for name, config in VARIANTS.items()}
    warmup = batches(12)  # two watched steps of the default: both compiled graphs exist after it
    for run in runs.values():
        _steps(run, warmup, device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        round_batches = batches(steps)
        for name, run in runs.items():
            times[name].append(_steps(run, round_batches, device))
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "mode": "compiled" if compiled else "eager",
        "step_ms": {name: 1e3 * value for name, value in median.items()},
        "cost": {name: median[name] / median["off"] - 1 for name in runs if name != "off"},
        "round_ms": {name: [1e3 * v for v in values] for name, values in times.items()},
        "moves": {name: len(run["controller"].moves) for name, run in runs.items() if run["controller"]},
    }


def main() -> None:
    """Parse arguments, measure, print and save."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=list(PRESETS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [measure(args.preset, args.batch_size, args.steps, args.rounds, mode == "compiled", device)
               for mode in args.modes.split(",")]
    table = Table(title=f"controller cost, GPT {args.preset}, batch {args.batch_size}, {torch.get_num_threads()} threads")
    for column in ("mode", "variant", "step ms", "cost", "moves"):
        table.add_column(column)
    for result in results:
        for name, ms in result["step_ms"].items():
            cost = result["cost"].get(name)
            table.add_row(result["mode"], name, f"{ms:.1f}", "-" if cost is None else f"{100 * cost:+.1f} %",
                          str(result["moves"].get(name, "-")))
    default_console().print(table)
    path = write_result("controller", device, {
        "preset": args.preset, "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
        "threads": torch.get_num_threads(), "results": results,
        "command": "OMP_NUM_THREADS=1 python bench/controller.py",
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
