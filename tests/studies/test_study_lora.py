"""studies/lora.py: bytes per frozen base parameter and paired gaps of every variant."""

from __future__ import annotations

import pytest

from conftest import load_study


@pytest.mark.slow
@pytest.mark.integration
def test_lora_study_measures_bytes_and_paired_gaps_of_every_variant() -> None:
    pytest.importorskip("peft", reason="studies/lora.py needs peft: pip install 'amp8[dev]'")
    lora = load_study("lora")
    rows = {row["level"]: row for row in lora.base_bytes(lora.LlamaSpec(n_layer=1), rank=8)}
    assert set(rows) == set(lora.LEVELS)
    assert rows["O3"]["fp8_layer_base_bytes_per_param"] <= 1.1
    assert rows["O1"]["fp8_layer_base_bytes_per_param"] == pytest.approx(2.0, abs=1e-3)
    config = lora.StudyConfig(seeds=(0, 1), pretrain_steps=1, finetune_steps=2, batch_size=2, warmup=1, eval_batches=1)
    result = lora.study(config)
    assert set(result["gap_percent"]) == set(lora.VARIANTS) - {"fp32"}
    assert all(len(gap["per_seed"]) == 2 and gap["stderr"] is not None for gap in result["gap_percent"].values())
    assert result["gap_percent"]["null"]["mean"] == pytest.approx(0.0, abs=0.01)
