"""studies/numerics_ablation.py: its variants and groups, one step's gradient error, the markdown."""

from __future__ import annotations

import pytest

from conftest import load_study

numerics = load_study("numerics_ablation")


def test_numerics_ablation_names_every_variant_of_its_groups() -> None:
    for group, names in numerics.GROUPS.items():
        assert set(names) <= set(numerics.VARIANTS), f"group {group} names unknown variants"
    assert numerics.CONFIGS["docs-lr0.003"].warmup_steps == 0 and numerics.CONFIGS["docs-lr0.003"].lr == 3e-3


def test_numerics_gradient_error_measures_each_source() -> None:
    probe = numerics.gradient_error("stdlib-lr0.003", ["O1-e5m2", "wgrad-high"], train_steps=1, batches=1)
    rows = probe["variants"]
    assert set(rows) == {"O1-e5m2", "wgrad-high"}
    for name, row in rows.items():
        assert 10 < row["weight_grad_sqnr_db"] < 80 and row["worst_layer_sqnr_db"] <= row["weight_grad_sqnr_db"], name
        assert len(row["per_layer_db"]) == 4 * numerics.CONFIGS["stdlib-lr0.003"].model.n_layer
    # The weight-gradient GEMM in high precision removes one of the two roundings of dW.
    assert rows["wgrad-high"]["weight_grad_sqnr_db"] > rows["O1-e5m2"]["weight_grad_sqnr_db"]


def test_numerics_markdown_shows_mean_error_and_seeds() -> None:
    study = {"losses": {"O0": {"0": 2.0, "1": 2.2}, "O1": {"0": 2.02, "1": 2.2}}}
    numerics.summarize(study)
    assert study["mean_gap_percent"]["O1"] == pytest.approx(0.5)
    table = numerics.markdown({"studies": {"cfg": study}})
    assert "| O1 | +0.50 ± 0.50 (2) |" in table and "| O0 seed spread (max-min, %) | 10.00 |" in table
