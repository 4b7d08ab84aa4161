"""The step over a large plain tensor: updated where it is, or copied through a group.

    python bench/plain_in_place.py                    # CPU, one thread: GPT-2's tied table
    python bench/plain_in_place.py --device cuda --vocab 128256 --width 2048

A parameter amp8 keeps in float32 at O2 and O3 (a tied embedding table, a layer the speed
rule keeps in high precision) still takes low-bit moments, in an update group. A large one
(``amp8.optim.plan.IN_PLACE_ELEMENTS``) is a group of its own whose step reads its
gradient and writes its weight where they are; below that, its gradient and weight are
copied into the group's buffers and the weight copied back, 24 bytes an element, into
memory held through the step. The model here is a GPT-style stack whose output head reads
the embedding table (tied, so amp8 keeps it in float32). For each level it times
``optimizer.step()`` after an untimed backward, compiled (``fused=True``; ``--steps eager``
for the eager groups), for two copies of the model in turns: one as amp8 runs it, one built
with ``IN_PLACE_ELEMENTS`` above the table's size (its table copied as before). It records
the bytes each holds through a step (``UpdateGroup.step_bytes``). Results go to
bench/results/plain_in_place-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.optim import LowBitAdam, plan
from records import RESULTS, command_line, write_result
from timing import time_in_turns


class TiedModel(nn.Module):
    """Token embedding, ``blocks`` MLP blocks, and an output head tied to the embedding."""

    def __init__(self, vocab: int, width: int, blocks: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks)
        ))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for ``tokens``."""
        return self.head(self.blocks(self.embedding(tokens)))


def training_step(model: nn.Module, optimizer: LowBitAdam, tokens: torch.Tensor) -> Callable[[], None]:
    """What runs untimed before each step: ``zero_grad()``, a forward and a backward."""
    def run() -> None:
        optimizer.zero_grad()
        logits = model(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return run


def table_group(optimizer: LowBitAdam, table: nn.Parameter) -> Any:
    """The update group that holds ``table``."""
    return next(group for group in optimizer.update_groups if any(m.param is table for m in group.members))


def row(level: str, args: argparse.Namespace, device: torch.device, fused: bool) -> dict[str, Any]:
    """Step times and step memory at ``level``, the table in place and copied."""
    torch.manual_seed(0)
    base = TiedModel(args.vocab, args.width, args.blocks).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.tokens), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    runs = {}
    for name in ("in_place", "copied"):
        with warnings.catch_warnings():  # (that the tied head stays in high precision: this bench's point)
            warnings.filterwarnings("ignore", message="amp8: opt level")
            model, _ = amp8.initialize(copy.deepcopy(base), None, level)
        optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), amp8.LEVELS[level],
                                              fused=fused)
        before = training_step(model, optimizer, tokens)
        threshold = plan.IN_PLACE_ELEMENTS if name == "in_place" else model.embedding.weight.numel() + 1
        with mock.patch.object(plan, "IN_PLACE_ELEMENTS", threshold):  # read where the first step plans the groups
            before()
            optimizer.step()
        group = table_group(optimizer, model.embedding.weight)
        if (group.key.own is not None) != (name == "in_place"):
            raise RuntimeError(f"{name}: the table's group is not what this row measures")
        runs[name] = (optimizer, before, sum(sum(g.step_bytes) for g in optimizer.update_groups), model)
    (in_place, in_place_before, in_place_bytes, _), (copied, copied_before, copied_bytes, copied_model) = runs.values()
    in_place_s, copied_s = time_in_turns([in_place.step, copied.step], device, args.repeats,
                                         befores=[in_place_before, copied_before])
    if table_group(copied, copied_model.embedding.weight).key.own is not None:
        raise RuntimeError("copied: a step planned the groups again, with the table in place")
    return {
        "level": level, "step": "compiled" if fused else "eager", "table_elements": base.embedding.weight.numel(),
        "parameters": sum(p.numel() for p in base.parameters()),
        "in_place_ms": 1e3 * in_place_s, "copied_ms": 1e3 * copied_s, "in_place_vs_copied": in_place_s / copied_s,
        "in_place_step_bytes": in_place_bytes, "copied_step_bytes": copied_bytes,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=50257, help="rows of the tied table (GPT-2's by default)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", nargs="+", default=["O2", "O3"], choices=["O2", "O3"])
    parser.add_argument("--steps", nargs="+", default=["compiled"], choices=["compiled", "eager"],
                        help="the group steps to time (eager is slow on the CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each, per turn (three turns)")
    parser.add_argument("--in-place-elements", type=int, default=None,
                        help="the in-place threshold for this run (default: amp8's; lower, to try tiny sizes)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, device: torch.device, command: str) -> tuple[list[dict[str, Any]], Path]:
    """Every level's (and step's) row, and the JSON's path, written after each."""
    rows: list[dict[str, Any]] = []
    path = args.out
    for level in args.levels:
        for step in args.steps:
            rows.append(row(level, args, device, step == "compiled"))
            path = write_result("plain_in_place", device, {
                "command": command, "threads": torch.get_num_threads() if device.type == "cpu" else None,
                "model": f"TiedModel(vocab={args.vocab}, width={args.width}, blocks={args.blocks}), "
                         f"tokens {args.batch} x {args.tokens}",
                "in_place_elements": plan.IN_PLACE_ELEMENTS, "rows": rows,
            }, args.out)
    return rows, path


def main(argv: list[str] | None = None) -> Path:
    """Measure, print the table, and return the JSON's path."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    command = command_line("plain_in_place.py", argv)
    threshold = plan.IN_PLACE_ELEMENTS if args.in_place_elements is None else args.in_place_elements
    with mock.patch.object(plan, "IN_PLACE_ELEMENTS", threshold):
        rows, path = measure(args, device, command)
    table = Table(title="optimizer step with a float32 tied table: in place against copied (ms, in turns)")
    for column in ("level", "step", "in place", "copied", "ratio", "held in a step: in place", "copied"):
        table.add_column(column, justify="right")
    for result in rows:
        table.add_row(result["level"], result["step"], f"{result['in_place_ms']:.1f}", f"{result['copied_ms']:.1f}",
                      f"{result['in_place_vs_copied']:.2f}x", f"{result['in_place_step_bytes'] / 1e6:.1f} MB",
                      f"{result['copied_step_bytes'] / 1e6:.1f} MB")
    default_console().print(table)
    return path


if __name__ == "__main__":
    main()
