"""Token outliers in many layers: what the controller keeps in FP8, and at what loss.

    OMP_NUM_THREADS=1 python studies/stress_layers.py               # 7 variants x seeds 0-3, ~15 min on one core
    OMP_NUM_THREADS=1 python studies/stress_layers.py --seeds 0 --variants O1 O1-stressed-controller

The model is a token-wise MLP: each position's logits come from the bytes of its own
window (the last ``CONTEXT`` bytes, their embeddings side by side), through four
pre-LayerNorm residual MLP blocks and an untied head; positions never meet. Position 0
of every sequence is left out of the loss, and in the stressed runs its row of the input
of both Linears of blocks 1-3 (six of the eight FP8 layers, 75 % of their GEMM FLOPs) is
multiplied by a gain that ramps from 1 to ``2**MAX_LOG2_GAIN`` over the first 30 % of
the steps. In exact arithmetic that changes nothing: position 0 reaches only its own
logits, and its gradient is zero. In FP8, rowwise scales keep fprop (one scale per
token row), but wgrad contracts tokens, and one scale per column of tokens is set by the
outlier rows: every other token is flushed to zero, and the six layers stop learning.

Variants (``VARIANTS``): O0 stressed (the baseline), O1 unstressed (the target), O1
stressed without a controller, with high-precision wgrad everywhere, with wgrad's outlier
tokens split off everywhere (``Recipe(wgrad_outlier_split=True)``), and with the default
``amp8.Controller`` with and without its outlier rung. Every run trains 300 steps of
16 x 64 bytes of the standard library's code, AdamW at lr 2e-3 with 30 steps of warm-up
and cosine decay to 10 %, from the seed's weights and batch order, and is measured on
the same held-out batches. Writes studies/results/stress-layers-<device>.json: per run the
final validation loss, its gap to O0 of the same seed, the controller's moves and the
share of GEMM FLOPs left in FP8; per variant the mean gap and its standard error.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

import amp8
from amp8 import ControllerConfig, Recipe
from amp8.frontend import default_recipe
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch
from amp8.tools.experiments.stress import IGNORE_INDEX, OutlierInjection, OutlierStress, mask_position
from amp8.tools.experiments.train import evaluate, warmup_cosine_lr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

NAME = "stress-layers"
CONTEXT = 8
"""Bytes each position sees: itself and the seven before it."""
MAX_LOG2_GAIN = 24.0
STRESSED_BLOCKS = (1, 2, 3)
BASELINE = "O0-stressed"


@dataclass(frozen=True)
class Setup:
    """The training run every variant shares."""

    width: int = 128
    hidden: int = 512
    blocks: int = 4
    steps: int = 300
    batch_size: int = 16
    block_size: int = 64
    lr: float = 2e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    ramp_fraction: float = 0.3
    eval_batches: int = 8

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak."""
        return warmup_cosine_lr(step, self.lr, self.warmup, self.steps, self.min_lr_ratio)


class Block(nn.Module):
    """A pre-LayerNorm residual MLP over each position on its own."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` plus the MLP of its LayerNorm."""
        return h + self.proj(F.gelu(self.fc(self.norm(h))))


class TokenwiseMLP(nn.Module):
    """Next-byte logits of each position from its window of ``CONTEXT`` bytes."""

    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, setup.width // CONTEXT)
        self.blocks = nn.ModuleList(Block(setup.width, setup.hidden) for _ in range(setup.blocks))
        self.norm = nn.LayerNorm(setup.width)
        self.head = nn.Linear(setup.width, 256, bias=False)

    def get_output_embeddings(self) -> nn.Linear:
        """The output head (how amp8, like transformers, finds it)."""
        return self.head

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, 256) and the mean cross-entropy over the targets not ignored."""
        padded = F.pad(x, (CONTEXT - 1, 0))  # byte 0 before the sequence
        windows = padded.unfold(1, CONTEXT, 1)  # (B, T, CONTEXT)
        h = self.embed(windows).flatten(2)  # (B, T, width)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        return logits, loss


def outlier_injection(setup: Setup) -> OutlierInjection:
    """The outlier on position 0, its gain ramped from 1 to ``2**MAX_LOG2_GAIN`` over the
    first ``setup.ramp_fraction`` of the steps (``amp8.tools.experiments.stress``); the
    loop sets its ``step``."""
    return OutlierInjection(OutlierStress(max_log2_gain=MAX_LOG2_GAIN, ramp_fraction=setup.ramp_fraction), setup.steps)


def stressed_modules(model: TokenwiseMLP) -> list[nn.Module]:
    """The Linears whose input carries the outlier: both of each stressed block."""
    return [layer for index in STRESSED_BLOCKS for layer in (model.blocks[index].fc, model.blocks[index].proj)]


def attach(injection: OutlierInjection, model: TokenwiseMLP) -> None:
    """Scale the input of every stressed module by ``injection`` (forward pre-hooks)."""
    for module in stressed_modules(model):
        module.register_forward_pre_hook(lambda _module, args: (injection.scale(args[0]), *args[1:]))


@dataclass(frozen=True)
class Variant:
    """One configuration: opt level, recipe (None: ``initialize``'s default), controller
    settings (None: no controller), whether the outlier is injected."""

    level: str
    recipe: Recipe | None = None
    controller: ControllerConfig | None = None
    stressed: bool = True


DEFAULT = default_recipe(amp8.config.levels.O1)
"""What ``initialize`` runs at O1 with no recipe: rowwise scales, the head high."""
WGRAD_HIGH = DEFAULT.replace(override_linear_precision=(False, False, True))
VARIANTS: dict[str, Variant] = {
    BASELINE: Variant("O0"),
    "O1": Variant("O1", stressed=False),
    "O1-stressed": Variant("O1"),
    "O1-stressed-wgrad-high": Variant("O1", WGRAD_HIGH),
    "O1-stressed-outlier-split": Variant("O1", DEFAULT.replace(wgrad_outlier_split=True)),
    "O1-stressed-controller": Variant("O1", controller=ControllerConfig()),
    "O1-stressed-controller-no-split": Variant("O1", controller=ControllerConfig(split_wgrad_outliers=False)),
}


def run(name: str, seed: int, setup: Setup, corpus: Any, val: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Train variant ``name`` from ``seed``; its record."""
    variant = VARIANTS[name]
    torch.manual_seed(seed)
    model = TokenwiseMLP(setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.0)
    controller = None if variant.controller is None else amp8.Controller(variant.controller)
    if variant.level != "O0":
        model, optimizer = amp8.initialize(model, optimizer, variant.level, recipe=variant.recipe,
                                           controller=controller)
    injection = outlier_injection(setup)
    if variant.stressed:
        attach(injection, model)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(setup.steps):
        x, y = sample_batch(corpus.train, setup.batch_size, setup.block_size, generator)
        injection.step = step
        for group in optimizer.param_groups:
            group["lr"] = setup.lr_at(step)
        optimizer.zero_grad()
        _, loss = model(x, mask_position(y, 0))
        loss.backward()
        optimizer.step()
    record: dict[str, Any] = {
        "variant": name, "seed": seed, "final_val_loss": evaluate(model, val),
        "wall_s": time.perf_counter() - start,
    }
    if controller is not None:
        record["moves"] = [dataclasses.asdict(move) for move in controller.moves]
        record["gemm_fp8_share"] = controller.fp8_share()
        record["rungs"] = controller.rungs()
    return record


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Gaps to O0 of the same seed (percent); per variant their mean and standard error,
    and O0's seed spread (max - min over mean, percent)."""
    base = {run["seed"]: run["final_val_loss"] for run in runs if run["variant"] == BASELINE}
    gaps: dict[str, list[float]] = {}
    for run in runs:
        run["gap_percent"] = 100 * (run["final_val_loss"] - base[run["seed"]]) / base[run["seed"]]
        gaps.setdefault(run["variant"], []).append(run["gap_percent"])
    summary = {}
    for name, values in gaps.items():
        if name == BASELINE:
            continue
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
        shares = [run["gemm_fp8_share"] for run in runs if run["variant"] == name and "gemm_fp8_share" in run]
        summary[name] = {"mean_gap_percent": statistics.fmean(values), "standard_error": error,
                         "gemm_fp8_share": statistics.fmean(shares) if shares else None}
    losses = list(base.values())
    spread = 100 * (max(losses) - min(losses)) / statistics.fmean(losses) if len(losses) > 1 else None
    return {"variants": summary, "o0_seed_spread_percent": spread}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the study and write its JSON; print one line per variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=Setup.steps)
    args = parser.parse_args(argv)
    names = [BASELINE, *[name for name in args.variants if name != BASELINE]]
    setup = Setup(steps=args.steps)
    corpus = load_corpus(CorpusConfig())
    generator = torch.Generator().manual_seed(10_000)
    val = []
    for _ in range(setup.eval_batches):
        x, y = sample_batch(corpus.val, setup.batch_size, setup.block_size, generator)
        val.append((x, mask_position(y, 0)))
    runs = []
    for seed in args.seeds:
        for name in names:
            runs.append(run(name, seed, setup, corpus, val))
            print(f"seed {seed} {name}: {runs[-1]['final_val_loss']:.4f} ({runs[-1]['wall_s']:.0f} s)", flush=True)
    summary = summarize(runs)
    for name, line in summary["variants"].items():
        error = line["standard_error"]
        share = line["gemm_fp8_share"]
        print(f"{name:34s} {line['mean_gap_percent']:+.2f}" + (f" ± {error:.2f} %" if error is not None else " %")
              + (f"   FP8 share of GEMM FLOPs {100 * share:.1f} %" if share is not None else ""))
    print(f"O0 seed spread {summary['o0_seed_spread_percent']}")
    path = write_result(NAME, torch.device("cpu"), {
        "setup": dataclasses.asdict(setup), "stressed_blocks": list(STRESSED_BLOCKS), "max_log2_gain": MAX_LOG2_GAIN,
        "context": CONTEXT, "seeds": args.seeds, "summary": summary, "runs": runs,
    }, RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
