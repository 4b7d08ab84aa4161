"""studies/classifier_head.py: the head variants, paired over the same seeds."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import load_study


def test_classifier_head_study_pairs_the_head_variants(tmp_path: Path) -> None:
    """studies/classifier_head.py: the FP8 head variant runs its classifier as an Fp8Linear,
    the high one keeps it an nn.Linear, and every paired gap is over the same seeds."""
    classifier_head = load_study("classifier_head")
    config = classifier_head.Config(steps=2, seeds=(0, 1), batch_size=4, eval_samples=8, warmup=1)
    result = classifier_head.study(config)
    assert [row["head_fp8"] for row in result["O2 head fp8"]["runs"]] == [True, True]
    assert [row["head_fp8"] for row in result["O2 head high"]["runs"]] == [False, False]
    for name in classifier_head.GAPS:
        assert len(result[name]["per_seed"]) == 2 and result[name]["stderr"] >= 0, name
    tokens, labels = classifier_head.batch(config, torch.Generator().manual_seed(0), 64)
    votes = torch.nn.functional.one_hot(tokens % config.labels, config.labels).sum(1)
    assert torch.equal(votes.argmax(-1), labels) and votes.max(-1).values.min() >= config.planted
