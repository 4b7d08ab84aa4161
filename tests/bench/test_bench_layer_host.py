"""bench/layer_host.py: one forward, and a model's forward and backward (compiled, or eager with
compiled casts), timed per level."""

from __future__ import annotations

import pytest

from conftest import load_bench


def test_layer_host_times_one_forward_per_level() -> None:
    layer_host = load_bench("layer_host")
    times = layer_host.measure(repeats=3)
    assert set(times) == set(layer_host.LEVELS) and all(0 < t < 1 for t in times.values())


@pytest.mark.compile
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-compiled-casts"])
def test_layer_host_times_a_training_step_per_level(compiled: bool) -> None:
    layer_host = load_bench("layer_host")
    times = layer_host.measure_training(layers=2, repeats=2, compiled=compiled)
    assert set(times) == set(layer_host.LEVELS) and all(0 < t < 10 for t in times.values())
