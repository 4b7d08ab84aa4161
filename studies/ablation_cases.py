"""The configurations and variants of studies/numerics_ablation.py: what each study
trains (model, corpus, schedule) and what each variant changes against O0, by name, with
the named groups of variants the command line takes."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from amp8 import Recipe
from amp8.config.levels import FP8_COMPUTE_ONLY, override
from amp8.tools.experiments.compare import CompareConfig
from amp8.tools.experiments.corpus import CorpusConfig
from amp8.tools.experiments.gpt import PRESETS, GPTConfig
from amp8.tools.experiments.llama import LlamaSpec
from amp8.tools.experiments.paired import NULL, Variant, null_variant

BASE = CompareConfig(
    model=PRESETS["small"], steps=300, batch_size=16, eval_interval=300, eval_batches=32,
    seeds=1, ablation=False, torchao=False,
)
"""What every configuration shares: the small GPT, 300 steps of 16 x 64 bytes, one seed a run."""


def _config(corpus: str, lr: float, warmup: bool, decay: bool) -> CompareConfig:
    return BASE.replace(
        corpus=CorpusConfig(source=corpus), lr=lr, warmup_steps=20 if warmup else 0,
        weight_decay=0.1 if decay else 0.0,
    )


REALISTIC_MODELS: Mapping[str, GPTConfig | LlamaSpec] = {
    "gpt-untied": dataclasses.replace(PRESETS["small"], tie_head=False),
    "gpt-tied": PRESETS["small"],
    "llama": LlamaSpec(),
    "moe": LlamaSpec(n_expert=8, expert_top_k=2),
}
"""The models of the realistic studies: the small GPT with an output head of its own (as
most Llama-style models have) and with its head tied to the embedding, a byte-level
Llama from transformers (RMSNorm, rotary positions, grouped-query attention, gated MLP,
untied head), and its mixture-of-experts sibling, a Mixtral of the same shape with 8
experts, 2 a token."""


REALISTIC_LR = {"gpt-untied": 1e-3, "gpt-tied": 1e-3, "llama": 1e-3, "moe": 1e-3}
"""Peak learning rate per model, where runs are stable rather than chaotic: at 3e-3 over
300 steps the GPT's null variant alone moves 0.3 %, and one FP8 run of the Llama lands
2 % from O0 while its null variant stays within 0.02 %."""


def _realistic(model: str, corpus: str) -> CompareConfig:
    """Training as it is done: the model's peak lr (``REALISTIC_LR``) after 30 steps of
    warm-up, cosine decay to a tenth, AdamW decay 0.1 on matrices."""
    return BASE.replace(
        model=REALISTIC_MODELS[model], corpus=CorpusConfig(source=corpus), lr=REALISTIC_LR[model], warmup_steps=30,
        min_lr_ratio=0.1, weight_decay=0.1,
    )


CONFIGS: Mapping[str, CompareConfig] = {
    **{
        f"{corpus}-lr{lr:g}{'-warmup' if warmup else ''}{'-wd' if decay else ''}": _config(corpus, lr, warmup, decay)
        for corpus in ("docs", "stdlib") for lr in (3e-3, 1e-3)
        for warmup, decay in ((False, False), (True, True), (True, False), (False, True))
    },
    **{f"{model}-{corpus}": _realistic(model, corpus) for model in REALISTIC_MODELS for corpus in ("docs", "stdlib")},
}
"""Corpus x peak learning rate x (warm-up, weight decay) on the tied-head GPT, and the
realistic configurations ``<model>-<corpus>`` (see ``_realistic`` and ``REALISTIC_MODELS``).
"docs-lr0.003" (no warm-up, no decay, the language reference's prose) is the held-out
check; "stdlib-lr0.001-warmup-wd" is ``amp8 compare``'s old setting."""
REALISTIC_CONFIGS = tuple(name for name in CONFIGS if name.split("-")[0] in ("gpt", "llama", "moe"))

DEFAULT = Recipe.preset("rowwise").replace(output_head="high")
"""What ``initialize`` uses without a recipe (but for sharded O3): E4M3 everywhere,
power-of-two scales, one per row along each GEMM's contraction dimension, the output head
in high precision."""
HYBRID_ROWWISE = Recipe(granularity="rowwise", output_head="high")
"""Rowwise scales with HYBRID formats (E5M2 output gradients)."""
FIRST_LAYERS = ("blocks.0.attn.qkv", "lm.model.layers.0.self_attn.[qkv]_proj")
"""The first FP8 GEMMs of the GPT and of the Llama."""
E5M2_GRADS = Recipe(weight_grad_format="gradient", weight_grad_scaling="weight")
"""Weight gradients as amp8 0.1 stored them: E5M2, one scale per tensor."""
E4M3_GRADS = Recipe(weight_grad_format="E4M3", weight_grad_scaling="rowwise")
"""Weight gradients in E4M3 with one scale per output feature."""

VARIANTS: Mapping[str, Variant] = {variant.name: variant for variant in (
    null_variant(),
    Variant("O1-e5m2", "O1", E5M2_GRADS),
    Variant("O2-e5m2", "O2", E5M2_GRADS),
    Variant("O3-e5m2", "O3", E5M2_GRADS),
    Variant("O1", "O1", Recipe()),
    Variant("O2", "O2", Recipe()),
    Variant("O3", "O3", Recipe()),
    # one source at a time, against O1-e5m2
    Variant("fprop-high", "O1", E5M2_GRADS.replace(override_linear_precision=(True, False, False))),
    Variant("dgrad-high", "O1", E5M2_GRADS.replace(override_linear_precision=(False, True, False))),
    Variant("wgrad-high", "O1", E5M2_GRADS.replace(override_linear_precision=(False, False, True))),
    Variant("wgrad-e4m3-tensor", "O1", E5M2_GRADS.replace(weight_grad_format="E4M3")),
    Variant("wgrad-e4m3-rowwise", "O1", E4M3_GRADS),
    Variant("storage-high", FP8_COMPUTE_ONLY, Recipe()),
    Variant("grads-e4m3", "O1", E5M2_GRADS.replace(fp8_format="E4M3")),
    Variant("rowwise", "O1", E5M2_GRADS.replace(granularity="rowwise")),
    Variant("O2-fp32-moments", override("O2", exp_avg="fp32", exp_avg_sq="fp32"), E5M2_GRADS),
    *(Variant(f"{level}-act8", level, Recipe(activations="fp8")) for level in ("O1", "O2", "O3")),
    # the defaults: which layers stay high precision, the scale granularity, the formats
    Variant("O1-head-fp8", "O1", Recipe(output_head="fp8")),
    Variant("O1-head-high", "O1", Recipe(output_head="high")),
    Variant("O1-rowwise-head-fp8", "O1", DEFAULT.replace(output_head="fp8")),
    Variant("O1-rowwise-hybrid", "O1", HYBRID_ROWWISE),
    *(Variant(f"default-{level}", level, DEFAULT) for level in ("O1", "O2", "O3")),
    *(Variant(f"tensorwise-{level}", level, Recipe()) for level in ("O2", "O3")),
    Variant("default-O2-fp32-m", override("O2", exp_avg="fp32"), DEFAULT),
    Variant("default-O2-fp32-v", override("O2", exp_avg_sq="fp32"), DEFAULT),
    # one source at a time, against the default
    Variant("default-compute-only", FP8_COMPUTE_ONLY, DEFAULT),
    Variant("default-fprop-high", "O1", DEFAULT.replace(override_linear_precision=(True, False, False))),
    Variant("default-dgrad-high", "O1", DEFAULT.replace(override_linear_precision=(False, True, False))),
    Variant("default-wgrad-high", "O1", DEFAULT.replace(override_linear_precision=(False, False, True))),
    Variant("default-first-layer-high", "O1", DEFAULT.replace(high_precision_layers=FIRST_LAYERS)),
    # the same sources against rowwise scales with HYBRID formats
    Variant("hybrid-compute-only", FP8_COMPUTE_ONLY, HYBRID_ROWWISE),
    Variant("hybrid-wgrad-high", "O1", HYBRID_ROWWISE.replace(override_linear_precision=(False, False, True))),
    Variant("torchao-tensorwise", "O0", torchao="tensorwise"),
    Variant("torchao-rowwise", "O0", torchao="rowwise"),
)}
GROUPS: Mapping[str, tuple[str, ...]] = {
    "before": ("O1-e5m2", "O2-e5m2", "O3-e5m2"),
    "levels": ("O1", "O2", "O3"),
    "targets": (NULL, "O1", "O2", "O3"),
    "activations": ("O1-act8", "O2-act8", "O3-act8"),
    "sources": ("grads-e4m3", "wgrad-high", "fprop-high", "storage-high", "wgrad-e4m3-rowwise", "dgrad-high"),
    "defaults": (NULL, "default-O1", "default-O2", "default-O3", "torchao-rowwise"),
    "tensorwise": ("tensorwise-O2", "tensorwise-O3"),
    "first-moment": ("default-O2", "default-O2-fp32-m", "default-O2-fp32-v"),
    "head-and-scales": ("O1-head-fp8", "O1-head-high", "O1-rowwise-head-fp8", "O1-rowwise-hybrid",
                        "torchao-tensorwise"),
    "default-sources": ("default-compute-only", "default-wgrad-high", "default-fprop-high",
                        "default-dgrad-high", "default-first-layer-high"),
    "gradients": ("O1-e5m2", "O1", "fprop-high", "dgrad-high", "wgrad-high", "wgrad-e4m3-tensor",
                  "wgrad-e4m3-rowwise", "grads-e4m3", "rowwise"),
}
"""Named lists of variants: the levels before and after the fix, the levels beside the
null variant (O0 from initial weights perturbed by 1e-6: the drift of runs that differ
by rounding alone), the levels with FP8 activations, the per-source study, the one-step
gradient study (``--gradients``)."""
TARGET_CONFIGS = tuple(f"{corpus}-lr{lr:g}{warmup}" for corpus in ("docs", "stdlib")
                       for lr in (3e-3, 1e-3) for warmup in ("", "-warmup"))
"""The configurations of the targets: two corpora, peak lr 3e-3 and 1e-3, with and
without warm-up, no weight decay (``--configs targets``)."""
