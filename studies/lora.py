"""LoRA fine-tuning on an amp8 base: bytes per frozen base parameter, and a paired study
of the final validation loss against a float32 base.

    python studies/lora.py                                  # 3 seeds, about 4 minutes on 2 CPU cores
    python studies/lora.py --seeds 0 1 2 3 4 --finetune-steps 200

Model: the byte-level Llama of the experiments (``LlamaSpec()``: 2 layers, width 128,
untied head), LoRA (Hugging Face PEFT, rank 8, alpha 16) on every projection of its
blocks, adapters trained alone. Each seed pretrains one base in float32 on the standard
library's code (``--pretrain-steps``), then fine-tunes adapters from the same adapter
init, with the same batches in the same order, on the language reference's prose, with
warm-up and cosine decay, for each base:

- ``fp32``: the pretrained base as it is (the reference);
- ``null``: the same with the base perturbed by 1e-6 (relative): how much rounding alone
  moves a run;
- ``bf16``: the base's weights rounded to bfloat16;
- ``O1``, ``O2``, ``O3``: ``get_peft_model`` then ``amp8.initialize`` at that level, the
  adapters' AdamW becoming amp8's ``LowBitAdam``.

The gap is ``100 * (loss - loss_fp32) / loss_fp32`` of the final validation loss, per
seed, then mean and standard error over seeds. Bytes: what ``amp8.report`` reads for the
frozen base weights of the FP8 layers and for the whole frozen base, against a bfloat16
base (2 bytes) and QLoRA's 4-bit NF4 (0.5 bytes, quantization constants aside).
Results go to studies/results/lora-<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import amp8
from amp8.tools.experiments.corpus import ByteCorpus, CorpusConfig, load_corpus, sample_batch
from amp8.tools.experiments.llama import LlamaSpec
from amp8.tools.experiments.paired import standard_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

LEVELS = ("O1", "O2", "O3")
VARIANTS = ("fp32", "null", "bf16", *LEVELS)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BF16_BYTES = 2.0
QLORA_NF4_BYTES = 0.5


@dataclass(frozen=True)
class StudyConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    pretrain_steps: int = 100
    finetune_steps: int = 60
    batch_size: int = 8
    rank: int = 8
    pretrain_lr: float = 3e-3
    finetune_lr: float = 3e-3
    warmup: int = 10
    eval_batches: int = 8


def lora_config(rank: int) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)


def pretrain(spec: LlamaSpec, corpus: ByteCorpus, config: StudyConfig, seed: int) -> nn.Module:
    """A float32 base trained ``config.pretrain_steps`` steps on ``corpus``."""
    model = spec.build(torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr)
    generator = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(config.pretrain_steps):
        x, y = sample_batch(corpus.train, config.batch_size, spec.block_size, generator)  # (B, T)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def lora_on(base: nn.Module, variant: str, config: StudyConfig, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of ``base`` with LoRA adapters (drawn under ``seed``) on the base ``variant``
    names, and the adapters' optimizer."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for param in model.parameters():
            if variant == "null":
                param.mul_(1 + 1e-6)
            elif variant == "bf16":
                param.copy_(param.bfloat16().float())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20_000 + seed)
        model = get_peft_model(model, lora_config(config.rank))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.finetune_lr)
    if variant in LEVELS:
        model, optimizer = amp8.initialize(model, optimizer, variant)  # type: ignore[assignment]
    return model, optimizer


def finetune(
    model: nn.Module, optimizer: torch.optim.Optimizer, corpus: ByteCorpus, spec: LlamaSpec,
    config: StudyConfig, seed: int,
) -> float:
    """Train the adapters with warm-up and cosine decay; the final validation loss."""
    steps = config.finetune_steps

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - config.warmup) / max(steps - config.warmup, 1)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(30_000 + seed)
    model.train()
    for _ in range(steps):
        x, y = sample_batch(corpus.train, config.batch_size, spec.block_size, generator)  # (B, T)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return validation_loss(model, corpus, spec, config)


@torch.no_grad()
def validation_loss(model: nn.Module, corpus: ByteCorpus, spec: LlamaSpec, config: StudyConfig) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(40_000)
    losses = []
    for _ in range(config.eval_batches):
        x, y = sample_batch(corpus.val, config.batch_size, spec.block_size, generator)
        losses.append(model(x, y)[1].item())
    return statistics.fmean(losses)


def base_bytes(spec: LlamaSpec, rank: int) -> list[dict[str, Any]]:
    """Bytes per frozen base parameter of each level after one step, as the report reads them."""
    rows = []
    for level in LEVELS:
        model = get_peft_model(spec.build(torch.Generator().manual_seed(0)), lora_config(rank))
        model, optimizer = amp8.initialize(
            model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), level
        )
        x = torch.randint(0, spec.vocab_size, (2, spec.block_size))
        model(x, x)[1].backward()
        optimizer.step()
        report = amp8.report(model, optimizer)
        rows.append({
            "level": level,
            "fp8_layer_base_bytes_per_param": report.frozen_bytes_per_param(fp8_layers_only=True),
            "whole_base_bytes_per_param": report.frozen_bytes_per_param(),
            "adapter_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "base_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        })
    return rows


def study(config: StudyConfig) -> dict[str, Any]:
    """The paired study: final validation losses per seed and variant, and the gaps."""
    spec = LlamaSpec()
    pretraining = load_corpus(CorpusConfig(max_bytes=512 * 1024))
    finetuning = load_corpus(CorpusConfig(max_bytes=512 * 1024, source="docs"))
    losses: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    before: list[float] = []  # the base's own validation loss on the fine-tuning corpus
    for seed in config.seeds:
        base = pretrain(spec, pretraining, config, seed)
        before.append(validation_loss(base, finetuning, spec, config))
        for variant in VARIANTS:
            model, optimizer = lora_on(base, variant, config, seed)
            losses[variant].append(finetune(model, optimizer, finetuning, spec, config, seed))
        print(f"seed {seed}: base {before[-1]:.4f}; " + ", ".join(f"{v} {losses[v][-1]:.4f}" for v in VARIANTS),
              flush=True)
    gaps = {}
    for variant in VARIANTS[1:]:
        per_seed = [100 * (loss - ref) / ref for loss, ref in zip(losses[variant], losses["fp32"])]
        gaps[variant] = {"per_seed": per_seed, "mean": statistics.fmean(per_seed), "stderr": standard_error(per_seed)}
    return {"model": spec.name, "base_loss_before_finetuning": before, "losses": losses, "gap_percent": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(StudyConfig.seeds))
    parser.add_argument("--pretrain-steps", type=int, default=StudyConfig.pretrain_steps)
    parser.add_argument("--finetune-steps", type=int, default=StudyConfig.finetune_steps)
    args = parser.parse_args()
    config = StudyConfig(seeds=tuple(args.seeds), pretrain_steps=args.pretrain_steps,
                         finetune_steps=args.finetune_steps)
    start = time.perf_counter()
    bytes_rows = base_bytes(LlamaSpec(), config.rank)
    for row in bytes_rows:
        print(f"{row['level']}: {row['fp8_layer_base_bytes_per_param']:.4f} bytes per frozen base parameter in "
              f"FP8 layers, {row['whole_base_bytes_per_param']:.4f} over the whole base "
              f"(bf16 {BF16_BYTES}, QLoRA NF4 {QLORA_NF4_BYTES})")
    result = study(config)
    for variant, gap in result["gap_percent"].items():
        stderr = gap["stderr"]
        print(f"{variant}: final validation loss gap to the fp32 base {gap['mean']:+.3f} % "
              f"(± {stderr:.3f} standard error)" if stderr is not None else f"{variant}: {gap['mean']:+.3f} %")
    payload = {
        "config": asdict(config),
        "bytes": bytes_rows,
        "references": {"bf16_bytes_per_param": BF16_BYTES, "qlora_nf4_bytes_per_param": QLORA_NF4_BYTES},
        **result,
        "seconds": time.perf_counter() - start,
    }
    print(f"wrote {write_result('lora', torch.device('cpu'), payload, RESULTS)}")


if __name__ == "__main__":
    main()
