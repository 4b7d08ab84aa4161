"""Activation bytes saved for backward per token and whole-model bytes per parameter, per
opt level, with and without FP8 activations.

    python bench/memory.py                          # the tiny and small GPT presets and the Llama example, batch 8
    python bench/memory.py --models medium --batch-size 4

For each model (byte-level GPT presets, and the two-layer Llama of
examples/hf_transformers.py when transformers is installed): O0 in FP32 and under BF16
autocast, then O1-O3 at every granularity (tensorwise, rowwise, block), each with
activations saved as they are and with ``Recipe(activations="fp8")``. One training step
from the same weights and batch (AdamW), then a second forward and backward:
``amp8.count_saved_bytes`` counts what the first forward saves (each storage once;
parameters and autocast's copies of them apart), and ``amp8.report`` reads the bytes per
parameter the model and optimizer hold with a gradient in place (the whole model, and
over FP8 layers). ``vs_bf16`` is the ratio of saved bytes to O0 under BF16 autocast.
Results go to bench/results/memory-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from rich.table import Table
from torch import nn

import amp8
from amp8.monitor.console import default_console
from amp8.tools.experiments.gpt import GPT, PRESETS
from records import write_result

LLAMA = "llama"
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


def _llama() -> nn.Module:
    """The two-layer byte-vocabulary Llama of examples/hf_transformers.py."""
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_transformers.py"
    spec = importlib.util.spec_from_file_location("amp8_example_hf_transformers", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # its dataclasses look themselves up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.build_model()


def build(name: str) -> tuple[nn.Module, int, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``(model, context length, loss(model, x, y))`` of a GPT preset or the Llama."""
    if name == LLAMA:
        torch.manual_seed(0)
        return _llama(), 64, lambda model, x, y: model(input_ids=x, labels=x).loss
    config = PRESETS[name]
    return GPT(config, torch.Generator().manual_seed(0)), config.block_size, lambda model, x, y: model(x, y)[1]


def measure(name: str, case: dict[str, Any], batch_size: int, device: torch.device) -> dict[str, Any]:
    """Saved bytes per token and bytes per parameter of ``name`` in ``case``."""
    model, block_size, loss_of = build(name)
    model = model.to(device)
    recipe = GRANULARITIES[case["granularity"] or "tensorwise"].replace(activations=case["activations"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp8.initialize(model, optimizer, case["level"], recipe=recipe, layer_selection="all")
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (batch_size, block_size), generator=generator).to(device) for _ in range(2))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if case["autocast"] else contextlib.nullcontext()
    with autocast, amp8.count_saved_bytes(model) as saved:
        loss = loss_of(model, x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with autocast:
        loss = loss_of(model, x, y)
    loss.backward()
    precision = amp8.report(model, optimizer)
    tokens = x.numel()
    return {
        "bytes_per_token": saved.per_token(tokens),
        "by_dtype_per_token": {name: count / tokens for name, count in saved.by_dtype.items()},
        "parameter_copy_bytes": saved.parameter_copy_bytes,
        "bytes_per_param": precision.bytes_per_param,
        "fp8_bytes_per_param": precision.fp8_bytes_per_param,
    }


def run(models: list[str], batch_size: int, device: torch.device) -> dict[str, Any]:
    """Measure every case for every model; each case also gets its ratio to O0 under
    BF16 autocast."""
    results: dict[str, Any] = {}
    for preset in models:
        rows = [{**case, **measure(preset, case, batch_size, device)} for case in cases()]
        bf16 = next(row["bytes_per_token"] for row in rows if row["level"] == "O0" and row["autocast"]
                    and row["activations"] == "high")
        for row in rows:
            row["vs_bf16"] = row["bytes_per_token"] / bf16
        results[preset] = rows
    return results


def table(results: dict[str, Any]) -> Table:
    """The results as a rich table, one row per case and preset."""
    out = Table(title="amp8 activation bytes saved for backward per token, bytes per parameter")
    for title in ("model", "level", "granularity", "activations", "bytes/token", "vs O0 BF16", "bytes/param",
                  "over FP8 layers"):
        out.add_column(title, justify="left" if title in ("model", "level", "granularity", "activations") else "right")
    for preset, rows in results.items():
        for row in rows:
            level = row["level"] + (" BF16 autocast" if row["autocast"] else "")
            out.add_row(preset, level, row["granularity"] or "-", row["activations"],
                        f"{row['bytes_per_token']:,.0f}", f"{row['vs_bf16']:.3f}", f"{row['bytes_per_param']:.2f}",
                        f"{row['fp8_bytes_per_param']:.2f}")
    return out


def main() -> None:
    """Run the benchmark from the command line and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small", LLAMA], choices=[*PRESETS, LLAMA])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    models = [name for name in args.models if name != LLAMA or importlib.util.find_spec("transformers")]
    results = run(models, args.batch_size, device)
    default_console().print(table(results))
    path = write_result("memory", device, {"batch_size": args.batch_size, "models": results})
    default_console().print(f"wrote {path}")


if __name__ == "__main__":
    main()
