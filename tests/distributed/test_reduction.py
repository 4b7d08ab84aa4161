"""``GradientReduction.attach`` and ``data_parallel_group``: what one process can check
(tests/distributed/test_data_parallel.py trains with them on two)."""

from __future__ import annotations

import pytest
import torch

import amp8
from amp8.distributed import DataParallelGroup, GradientReduction, data_parallel_group
from conftest import mlp


@pytest.mark.parametrize(
    ("optimizer", "group", "named"),
    [
        (lambda model: torch.optim.AdamW(model.parameters()), DataParallelGroup, "amp8.optim.LowBitAdam"),
        (lambda model: amp8.optim.LowBitAdam(model.parameters()), lambda: None, "data_parallel_group"),
    ],
    ids=["torch optimizer", "no group"],
)
def test_attach_refuses_what_it_cannot_average(optimizer, group, named: str) -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, "O2", recipe=amp8.Recipe())
    built = optimizer(model)
    with pytest.raises(TypeError, match=named):
        GradientReduction.attach(built, group())
    assert getattr(built, "gradient_average", None) is None


@pytest.mark.parametrize("level", ["O0", "O1-compute", "O2"])
def test_a_model_in_one_process_has_no_data_parallel_group(level: str) -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, level, recipe=amp8.Recipe())
    assert data_parallel_group(model) is None
