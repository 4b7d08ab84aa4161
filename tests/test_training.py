"""O1 end to end on a real dataset: the quickstart example's digits classifier."""

import pytest

from conftest import load_example


@pytest.mark.convergence
@pytest.mark.parametrize("recipe_scaling", ["current", "delayed"])
def test_o1_accuracy_within_two_points_of_fp32(recipe_scaling: str) -> None:
    quickstart = load_example("quickstart")
    config = quickstart.Config(epochs=12)
    fp32_accuracy, _, _ = quickstart.train("O0", config)
    o1_accuracy, model, optimizer = quickstart.train("O1", config, recipe_scaling=recipe_scaling)
    assert fp32_accuracy > 0.9, f"the FP32 baseline itself is off: {fp32_accuracy:.3f}"
    assert abs(o1_accuracy - fp32_accuracy) <= 0.02, (
        f"O1 {100 * o1_accuracy:.1f}% vs FP32 {100 * fp32_accuracy:.1f}%"
    )
    assert optimizer.skipped_steps == 0
