"""What ``amp8.ReportLog`` costs a training step at its default interval.

    OMP_NUM_THREADS=1 python bench/report_log.py                 # the "medium" GPT, O1 and O2
    python bench/report_log.py --preset small --every 10

Per level, one process, one thread: the median time of a plain training step, of a step
whose operands are watched (the step before each record), and of one record (the report
of the model and optimizer, written as a JSON line). The log's share of a step at
interval N is ``(watched - plain + record) / (N * plain)``: what N steps with the log
take beyond N steps without it, over the latter. Results go to
``--out``/report_log-<device>.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import amp8
from amp8.monitor.operand_health import watch_operands
from amp8.monitor.report_log import DEFAULT_EVERY
from amp8.tools.experiments.gpt import GPT, GPTConfig
from records import RESULTS, command_line, write_result
from timing import time_call

LEVELS = ("O1", "O2")


def measure(level: str, preset: str, batch_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of a plain step, a watched step and a record, for ``level``."""
    config = GPTConfig.from_preset(preset)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp8.initialize(model, optimizer, level)
    idx = torch.randint(0, config.vocab_size, (batch_size, config.block_size))

    def step() -> None:
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def watched_step() -> None:
        with watch_operands(model):
            step()

    for _ in range(2):  # warm up
        step()
    with tempfile.TemporaryDirectory() as folder:
        log = amp8.ReportLog(model, optimizer, Path(folder) / "report.jsonl", every=10**9)
        cpu = torch.device("cpu")
        plain = time_call(step, cpu, 0, repeats)
        watched = time_call(watched_step, cpu, 0, repeats)
        record = time_call(log.record, cpu, 0, repeats)
        log.remove()
    return {"plain_step_s": plain, "watched_step_s": watched, "record_s": record}


def share_of_step(times: dict[str, float], every: int) -> float:
    """The log's share of a training step at interval ``every`` (see the module docstring)."""
    return (times["watched_step_s"] - times["plain_step_s"] + times["record_s"]) / (every * times["plain_step_s"])


def main(argv: list[str] | None = None) -> Path:
    """Measure each level; print and write the JSON; its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for level in args.levels:
        times = measure(level, args.preset, args.batch_size, args.repeats)
        share = share_of_step(times, args.every)
        rows.append({"level": level, **times, "every": args.every, "share_of_step": share})
        print(f"{level}: step {1e3 * times['plain_step_s']:.1f} ms, watched {1e3 * times['watched_step_s']:.1f} ms, "
              f"record {1e3 * times['record_s']:.1f} ms: {100 * share:.2f} % of a step every {args.every} steps")
    return write_result("report_log", torch.device("cpu"), {
        "command": command_line("report_log.py", argv), "threads": 1, "preset": args.preset,
        "batch_size": args.batch_size, "rows": rows,
    }, args.out)


if __name__ == "__main__":
    main()
