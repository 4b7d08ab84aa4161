"""studies/defaults_price.py: Llama-3-8B's GEMM FLOPs per token and the head's share."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import load_study


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_defaults_price_counts_llama3_8b_head_flops_exactly() -> None:
    defaults_price = load_study("defaults_price")
    with torch.device("meta"):
        model = defaults_price._llama3_8b()
    row = defaults_price.price(model)
    head = 6 * 4096 * 128256
    layer = 6 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # q, o; k, v; gate, up, down
    assert row["gemm_flops_per_token"] == 32 * layer + head
    assert row["head_share"] == head / (32 * layer + head) and row["unfit_share"] == 0
    expected = row["expected_h100_speedup_over_bf16"]
    assert 1.0 < expected["rowwise"] < defaults_price.PUBLISHED["rowwise"]
    assert expected["rowwise"] < expected["tensorwise"] < defaults_price.PUBLISHED["tensorwise"]
