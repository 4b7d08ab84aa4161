"""Activation bytes saved for backward per token, per opt level, with and without FP8 activations.

    python bench/memory.py                          # the tiny and small GPT presets, batch 8
    python bench/memory.py --presets medium --batch-size 4

For each byte-level GPT preset: O0 in FP32 and under BF16 autocast, then O1-O3 at every
granularity (tensorwise, rowwise, block), each with activations saved as they are and
with ``Recipe(activations="fp8")``. One forward and backward from the same weights and
batch; ``amp8.count_saved_bytes`` counts what autograd saves (each storage once;
parameters and autocast's copies of them apart). ``vs_bf16`` is the ratio to O0 under
BF16 autocast. Results go to bench/results/memory-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from rich.table import Table

import amp8
from amp8.console import default_console
from amp8.experiments.gpt import GPT, PRESETS
from common import write_result

GRANULARITIES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe.preset("rowwise"),
    "block": amp8.Recipe.preset("deepseek"),
}
ACTIVATIONS = ("high", "fp8")


def cases() -> list[dict[str, Any]]:
    """Every measured configuration: level, granularity, activations, autocast."""
    found = [
        {"level": "O0", "granularity": None, "activations": activations, "autocast": autocast}
        for autocast in (False, True) for activations in ACTIVATIONS
    ]
    found += [
        {"level": level, "granularity": granularity, "activations": activations, "autocast": False}
        for level in ("O1", "O2", "O3") for granularity in GRANULARITIES for activations in ACTIVATIONS
    ]
    return found


def measure(preset: str, case: dict[str, Any], batch_size: int, device: torch.device) -> dict[str, Any]:
    """Saved bytes per token of one training step of ``preset`` in ``case``."""
    config = PRESETS[preset]
    model = GPT(config, torch.Generator().manual_seed(0)).to(device)
    recipe = GRANULARITIES[case["granularity"] or "tensorwise"].replace(activations=case["activations"])
    model, _ = amp8.initialize(model, None, case["level"], recipe=recipe, layer_selection="all")
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, config.vocab_size, (batch_size, config.block_size), generator=generator).to(device)
            for _ in range(2))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if case["autocast"] else contextlib.nullcontext()
    with autocast, amp8.count_saved_bytes(model) as saved:
        _, loss = model(x, y)
    loss.backward()
    tokens = x.numel()
    return {
        "bytes_per_token": saved.per_token(tokens),
        "by_dtype_per_token": {name: count / tokens for name, count in saved.by_dtype.items()},
        "parameter_copy_bytes": saved.parameter_copy_bytes,
    }


def run(presets: list[str], batch_size: int, device: torch.device) -> dict[str, Any]:
    """Measure every case for every preset; each FP8 case also gets its ratio to O0
    under BF16 autocast."""
    results: dict[str, Any] = {}
    for preset in presets:
        rows = [{**case, **measure(preset, case, batch_size, device)} for case in cases()]
        bf16 = next(row["bytes_per_token"] for row in rows if row["level"] == "O0" and row["autocast"]
                    and row["activations"] == "high")
        for row in rows:
            row["vs_bf16"] = row["bytes_per_token"] / bf16
        results[preset] = rows
    return results


def table(results: dict[str, Any]) -> Table:
    """The results as a rich table, one row per case and preset."""
    out = Table(title="amp8 activation bytes saved for backward per token")
    for title in ("preset", "level", "granularity", "activations", "bytes/token", "vs O0 BF16"):
        out.add_column(title, justify="right" if title.startswith(("bytes", "vs")) else "left")
    for preset, rows in results.items():
        for row in rows:
            level = row["level"] + (" BF16 autocast" if row["autocast"] else "")
            out.add_row(preset, level, row["granularity"] or "-", row["activations"],
                        f"{row['bytes_per_token']:,.0f}", f"{row['vs_bf16']:.3f}")
    return out


def main() -> None:
    """Run the benchmark from the command line and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=list(PRESETS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    results = run(args.presets, args.batch_size, device)
    default_console().print(table(results))
    path = write_result("memory", device, {"batch_size": args.batch_size, "presets": results})
    default_console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
