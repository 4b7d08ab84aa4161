"""Does a classification head need high precision? A small BERT sequence classifier
trained on a synthetic task at O2 with its ``classifier`` in FP8 (``output_head="fp8"``)
against the same run with it kept high (``output_head="high"``, the default recipe's,
which finds it by ``amp8.nn.swap.classification_head``), and at O0 for scale; paired seeds
(same init, same data), final held-out loss mean and standard error, beside a null variant.

    python studies/classifier_head.py                  # 3 seeds, 800 steps: studies/results/classifier_head-cpu.json
    python studies/classifier_head.py --steps 20 --seeds 1 --out-dir /tmp

The task: 32 tokens from a vocabulary of 256, each voting for class ``token % labels``:
random but for ``planted`` (10) positions that vote for one class drawn at random; the label
is the class with the most votes (the smallest on a tie). A bag-of-words count the model
learns in a few hundred steps without reaching zero loss, so a head that rounds its
logits badly shows in the final loss. ``labels`` is 32, a
multiple of 16 so that the head can take the FP8 GEMM at all (with fewer than 16 outputs
amp8 keeps it high: ``amp8.nn.swap.high_precision_reason``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import amp8
from amp8.frontend import default_recipe
from amp8.config.levels import resolve_level
from amp8.tools.experiments.train import warmup_cosine_lr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Config:
    """One study: the model, the task and the training run."""

    steps: int = 800
    seeds: tuple[int, ...] = (0, 1, 2)
    batch_size: int = 32
    seq_len: int = 32
    vocab: int = 256
    labels: int = 32
    hidden: int = 64
    layers: int = 2
    lr: float = 2e-3
    planted: int = 10
    warmup: int = 30
    lr_floor_ratio: float = 0.1
    eval_samples: int = 1024


VARIANTS = {
    "O0": ("O0", "high", False),
    "O0 null (init perturbed by 1e-6)": ("O0", "high", True),
    "O2 head fp8": ("O2", "fp8", False),
    "O2 head high": ("O2", "high", False),
}
"""name -> (opt level, Recipe.output_head, init perturbed). The null variant shows
how far rounding alone moves a run: a gap below it is no measurement."""

NULL_PERTURBATION = 1e-6
"""Relative noise of the null variant's init: ``p * (1 + 1e-6 * N(0, 1))``."""


def batch(config: Config, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens (size, seq_len), labels (size,))`` of the synthetic task."""
    tokens = torch.randint(0, config.vocab, (size, config.seq_len), generator=generator)
    planted = torch.randint(0, config.labels, (size, 1), generator=generator)  # the class most tokens vote for
    where = torch.rand(size, config.seq_len, generator=generator).argsort(-1)[:, : config.planted]
    offsets = config.labels * torch.randint(0, config.vocab // config.labels, (size, config.planted), generator=generator)
    tokens.scatter_(1, where, planted + offsets)
    votes = torch.nn.functional.one_hot(tokens % config.labels, config.labels).sum(1)  # (size, labels)
    return tokens, votes.argmax(-1)


def model_for(config: Config, seed: int) -> torch.nn.Module:
    """A BertForSequenceClassification from a small config, initialized from ``seed``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    bert = BertConfig(
        vocab_size=config.vocab, hidden_size=config.hidden, num_hidden_layers=config.layers,
        num_attention_heads=4, intermediate_size=4 * config.hidden, max_position_embeddings=config.seq_len,
        num_labels=config.labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(bert)


def run(config: Config, seed: int, level: str, output_head: str, perturbed: bool = False) -> dict[str, float]:
    """Train one variant; its final held-out loss and accuracy, and where the head ran."""
    model = model_for(config, seed)
    if perturbed:
        noise = torch.Generator().manual_seed(2000 + seed)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + NULL_PERTURBATION * torch.randn(param.shape, generator=noise))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    recipe = default_recipe(resolve_level(level)).replace(output_head=output_head)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=level, recipe=recipe)
    head_fp8 = isinstance(model.classifier, amp8.nn.Fp8Linear)
    data = torch.Generator().manual_seed(1000 + seed)  # the same batches for every variant of a seed
    model.train()
    for step in range(config.steps):
        for group in optimizer.param_groups:  # type: ignore[union-attr]
            group["lr"] = warmup_cosine_lr(step, config.lr, config.warmup, config.steps, config.lr_floor_ratio)
        tokens, labels = batch(config, data, config.batch_size)
        loss = model(input_ids=tokens, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tokens, labels = batch(config, torch.Generator().manual_seed(99), config.eval_samples)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return {
        "loss": float(torch.nn.functional.cross_entropy(logits, labels)),
        "accuracy": float((logits.argmax(-1) == labels).float().mean()),
        "head_fp8": head_fp8,
    }


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def study(config: Config) -> dict[str, object]:
    """Every variant on every seed, with the paired gap of the FP8 head against the high one."""
    runs = {name: [run(config, seed, *variant) for seed in config.seeds] for name, variant in VARIANTS.items()}
    summary: dict[str, object] = {}
    for name, rows in runs.items():
        loss, loss_error = mean_and_error([row["loss"] for row in rows])
        summary[name] = {"loss_mean": loss, "loss_stderr": loss_error, "runs": rows}
    for name, (variant, baseline) in GAPS.items():
        gaps = [100 * (a["loss"] - b["loss"]) / b["loss"] for a, b in zip(runs[variant], runs[baseline])]
        gap, gap_error = mean_and_error(gaps)
        summary[name] = {"mean": gap, "stderr": gap_error, "per_seed": gaps}
    return summary


GAPS = {
    "paired gap, head fp8 vs high (% of loss)": ("O2 head fp8", "O2 head high"),
    "paired gap, null vs O0 (% of loss)": ("O0 null (init perturbed by 1e-6)", "O0"),
    "paired gap, O2 head high vs O0 (% of loss)": ("O2 head high", "O0"),
}
"""name -> (variant, baseline) of each paired gap the study reports."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seeds", type=int, default=len(Config.seeds), help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first .. first + n - 1")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    config = Config(steps=args.steps, seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)))
    result = {"config": asdict(config), **study(config)}
    print(write_result("classifier_head", torch.device("cpu"), result, args.out_dir))
    for name in VARIANTS:
        print(f"{name}: loss {result[name]['loss_mean']:.4f} +- {result[name]['loss_stderr']:.4f}")
    for name in GAPS:
        print(f"{name}: {result[name]['mean']:+.2f} +- {result[name]['stderr']:.2f}")


if __name__ == "__main__":
    main()
