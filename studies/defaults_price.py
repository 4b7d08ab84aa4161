"""The speed price of amp8's default recipe, in GEMM FLOPs and in an expected H100 ratio.

    python studies/defaults_price.py

For each model, counts the GEMM FLOPs per token of its ``nn.Linear`` layers (forward and
both backward GEMMs: 6 x in x out) and the share the default leaves in high precision:
the output head (``Recipe.output_head="high"``, found by structure) and layers FP8
cannot run. The models are built on the meta device, so Llama-3-8B's shapes cost
nothing. The expected step-time ratio over BF16 on an H100 is an estimate until a GPU
measures it: torchao's published Llama-3-8B figures (tensorwise 1.25x, rowwise 1.10x over
BF16, every Linear in FP8) with the FLOPs left in high precision taken out of the saving
(Amdahl: ``1 / (1 - saving * fp8_share)`` with ``saving = 1 - 1 / published``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp8.nn.swap import high_precision_reason, output_heads, shared_weight_names
from amp8.tools.experiments.gpt import PRESETS
from amp8.tools.experiments.llama import LlamaSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

PUBLISHED = {"tensorwise": 1.25, "rowwise": 1.10}
"""torchao float8 training, Llama-3-8B on H100s: step-time speedup over BF16."""


def _llama3_8b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


MODELS = {
    "gpt-small-untied (study)": lambda: dataclasses.replace(PRESETS["small"], tie_head=False).build(),
    "llama-byte (study)": lambda: LlamaSpec().build(),
    "gpt-1b-untied": lambda: dataclasses.replace(PRESETS["gpt-1b"], tie_head=False).build(),
    "llama3-8b": _llama3_8b,
}


def price(model: nn.Module) -> dict[str, Any]:
    """GEMM FLOPs per token of ``model``'s Linear layers, and the shares the default
    recipe runs in FP8 and leaves in high precision (the head, and layers FP8 cannot run)."""
    heads, shared = output_heads(model), shared_weight_names(model)
    total = head = unfit = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        flops = 6 * module.in_features * module.out_features
        total += flops
        if high_precision_reason(module, shared) is not None:
            unfit += flops
        elif id(module) in heads:
            head += flops
    fp8_share = (total - head - unfit) / total
    expected = {recipe: 1 / (1 - (1 - 1 / speedup) * fp8_share) for recipe, speedup in PUBLISHED.items()}
    return {
        "gemm_flops_per_token": total,
        "head_share": head / total,
        "unfit_share": unfit / total,
        "fp8_share": fp8_share,
        "expected_h100_speedup_over_bf16": expected,
    }


def main(argv: list[str] | None = None) -> Path:
    """Price the default recipe on every model; returns the path of the JSON written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    results = {}
    for name, build in MODELS.items():
        with torch.device("meta"):
            model = build()
        results[name] = row = price(model)
        expected = row["expected_h100_speedup_over_bf16"]
        print(f"{name:26s} head {100 * row['head_share']:5.2f}% of GEMM FLOPs, FP8 {100 * row['fp8_share']:6.2f}%; "
              f"expected vs BF16: rowwise {expected['rowwise']:.3f}x, tensorwise {expected['tensorwise']:.3f}x "
              f"(published with every Linear in FP8: {PUBLISHED['rowwise']}x, {PUBLISHED['tensorwise']}x)")
    return write_result("defaults_price", torch.device("cpu"), {
        "method": __doc__.split("\n\n")[1].replace("\n", " "), "published": PUBLISHED, "models": results,
    }, args.out)


if __name__ == "__main__":
    main()
