"""bench/memory.py: bytes saved per token and bytes per parameter of every case."""

from __future__ import annotations

import pytest
import torch

from conftest import load_bench


@pytest.mark.slow
def test_memory_bench_measures_every_case_and_fp8_halves_bf16() -> None:
    memory = load_bench("memory")
    rows = memory.run(["tiny"], 2, torch.device("cpu"))["tiny"]
    assert len(rows) == len(memory.cases())
    for row in rows:
        assert row["bytes_per_token"] > 0, row
        if row["activations"] == "fp8":
            assert row["vs_bf16"] <= 0.5, row
    levels = {(row["level"], row["granularity"], row["activations"]): row for row in rows if not row["autocast"]}
    assert levels[("O0", None, "high")]["bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    assert levels[("O2", "tensorwise", "high")]["fp8_bytes_per_param"] == pytest.approx(6.0, abs=0.01)
    print(memory.table({"tiny": rows}).title)


@pytest.mark.slow
@pytest.mark.integration
def test_memory_bench_llama_untied_tables_reach_the_level_bytes() -> None:
    pytest.importorskip("transformers", reason="the Llama example needs transformers (pip install 'amp8[hf]')")
    memory = load_bench("memory")
    case = {"level": "O2", "granularity": "tensorwise", "activations": "high", "autocast": False}
    row = memory.measure(memory.LLAMA, case, 2, torch.device("cpu"))
    # Every FP8 layer and the untied token table at 6 bytes; norms (1/300 of it) at 12.
    assert row["bytes_per_param"] <= 6.1, row
