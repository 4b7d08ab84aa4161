"""Ranks that set up FP8 training differently fail at once, on every rank, with the
first difference; two CPU processes over gloo."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import amp8
import multiprocess
from amp8.config.levels import O1
from amp8.distributed.agreement import describe_setup
from conftest import mlp

# Each case: what rank 0 and rank 1 pass to initialize, and the message both must get.
CASES = {
    "level": (
        {"level": "O2"}, {"level": "O1"},
        "opt level name: 'O2' on rank 0, 'O1' on rank 1",
    ),
    "sharded-level": (
        {"level": "O3"}, {"level": "O2"},
        "opt level name: 'O3' on rank 0, 'O2' on rank 1",
    ),
    "fp8_format": (
        {"recipe": amp8.Recipe()}, {"recipe": amp8.Recipe(fp8_format="E4M3")},
        "recipe.fp8_format: 'HYBRID' on rank 0, 'E4M3' on rank 1",
    ),
    "scaling": (
        {"recipe": amp8.Recipe(scaling="delayed")}, {"recipe": amp8.Recipe()},
        "recipe.scaling: 'delayed' on rank 0, 'current' on rank 1",
    ),
    "hidden-size": (
        {"hidden": 48}, {"hidden": 64},
        "parameter #0: 0.weight (48, 32) float32 on rank 0, 0.weight (64, 32) float32 on rank 1",
    ),
    "extra-layer": (
        {}, {"extra_layer": True},
        "number of parameters: 4 on rank 0, 6 on rank 1",
    ),
}
# One rank fails its own checks: it raises its error, the other names the rank and error.
FAILURES = {
    "unknown-level": ({"level": "O1"}, {"level": "O5"}, "is not an amp8 opt level"),
    "bad-recipe-type": ({}, {"recipe": "HYBRID"}, "recipe must be an amp8.Recipe"),
    "unsupported-optimizer": ({}, {"sgd": True}, "amp8 cannot take over torch.optim.SGD"),
}
CASES["o0-against-o1"] = ({"level": "O0"}, {"level": "O1"}, "opt level name: 'O0' on rank 0, 'O1' on rank 1")
# Far below the process group's timeout: a mismatch must fail, not hang.
SECONDS_PER_CASE = 10.0


def _model(hidden: int = 64, extra_layer: bool = False) -> nn.Module:
    return mlp(32, hidden, hidden, 16, seed=None) if extra_layer else mlp(32, hidden, 16, seed=None)


def _initialize(setup: dict) -> None:
    model = _model(setup.get("hidden", 64), setup.get("extra_layer", False))
    optimizer_class = torch.optim.SGD if setup.get("sgd") else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    amp8.initialize(model, optimizer, setup.get("level", "O1"), recipe=setup.get("recipe"))


def _every_case(rank: int, world: int) -> dict[str, dict[str, object]]:
    """Run each mismatch, then a matching setup; the error and time of each on this rank."""
    results: dict[str, dict[str, object]] = {}
    for name, (rank0, rank1, _) in CASES.items():
        start = time.monotonic()
        try:
            _initialize(rank0 if rank == 0 else rank1)
            error = None
        except ValueError as caught:
            error = str(caught)
        results[name] = {"error": error, "seconds": time.monotonic() - start}
    for name, (rank0, rank1, _) in FAILURES.items():
        start = time.monotonic()
        try:
            _initialize(rank0 if rank == 0 else rank1)
            error = None
        except (ValueError, TypeError, RuntimeError) as caught:
            error = f"{type(caught).__name__}: {caught}"
        results[name] = {"error": error, "seconds": time.monotonic() - start}
    _initialize({})  # the ranks agree: initialize goes through to its collectives
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    timeout = 60 + SECONDS_PER_CASE * (len(CASES) + len(FAILURES))  # the processes' start-up, then the cases
    return multiprocess.run(_every_case, tmp_path_factory.mktemp("agreement"), timeout_s=timeout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_mismatch_fails_quickly_on_every_rank(
    outcomes: list[dict[str, dict[str, object]]], case: str, rank: int
) -> None:
    result = outcomes[rank][case]
    assert result["error"] is not None, f"rank {rank} initialized despite the {case} mismatch"
    assert CASES[case][2] in result["error"], result["error"]
    assert "Every rank must call amp8.initialize with the same opt_level, recipe and model" in result["error"]
    assert result["seconds"] < SECONDS_PER_CASE, f"the {case} mismatch took {result['seconds']:.1f} s"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(FAILURES))
def test_a_rank_that_fails_its_checks_stops_every_rank(
    outcomes: list[dict[str, dict[str, object]]], case: str
) -> None:
    failing, other = outcomes[1][case], outcomes[0][case]
    expected = FAILURES[case][2]
    assert failing["error"] is not None and expected in failing["error"], failing["error"]
    assert other["error"] is not None, f"rank 0 initialized though rank 1 failed ({case})"
    assert other["error"].startswith("RuntimeError: amp8.initialize failed on rank 1"), other["error"]
    assert expected in other["error"], other["error"]
    for result in (failing, other):
        assert result["seconds"] < SECONDS_PER_CASE, f"{case} took {result['seconds']:.1f} s"


def test_description_covers_level_recipe_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16))
    fields = dict(describe_setup(model, O1, amp8.Recipe(margin=2)))
    assert fields["opt level name"] == "'O1'"
    assert fields["opt level exp_avg"] == "'fp32'"
    assert fields["recipe.margin"] == "2"
    assert fields["recipe.override_linear_precision"] == "(False, False, False)"
    assert fields["number of parameters"] == "4"
    assert fields["number of buffers"] == "3"
    assert fields["parameter #0"] == "0.weight (16, 32) float32"
    assert fields["buffer #2"] == "1.num_batches_tracked () int64"
