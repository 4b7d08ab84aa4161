"""bench/step_profile.py: every level's step counted in its phases, compiled blocks as graph
calls, the gpt-1b counts solved exactly, the GEMM bytes derived as counted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from amp8.tools.experiments.gpt import PRESETS
from conftest import load_bench

step_profile = load_bench("step_profile")
counting = load_bench("counting")
step_model = load_bench("step_model")


def test_step_profile_tiny_counts_every_level_and_phase(tmp_path: Path) -> None:
    """Every level's step splits into the three phases; the GEMM FLOPs are the same work
    at every level, all high precision at O0 and mostly FP8 at O1-O3."""
    path = step_profile.main(["--preset", "tiny", "--batch-size", "2", "--steps", "1", "--optimizer", "reference",
                              "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["benchmark"] == "step_profile-tiny" and record["torch"] == torch.__version__
    assert set(record["levels"]) == set(step_model.LEVELS)
    gemm = {}
    for level, result in record["levels"].items():
        phases = result["phases"]
        for name in counting.PHASES:
            assert phases[name]["ops"] > 0 and phases[name]["bytes"] > 0 and phases[name]["cpu_ms"] > 0, (level, name)
            assert result["modeled_h100_ms"][name]["gpu_ms"] > 0, (level, name)
            stretches = result["stretches"][name]  # the phase split at its syncs, nothing lost
            assert len(stretches) == phases[name]["syncs"] + 1, (level, name, stretches)
            for key in counting.COUNTS:
                assert sum(s[key] for s in stretches) == phases[name][key], (level, name, key)
        assert result["modeled_h100_ms"]["step"] >= max(r["gpu_ms"] for n, r in result["modeled_h100_ms"].items()
                                                        if n in counting.PHASES), level
        gemm[level] = [phases[p]["fp8_flops"] + phases[p]["other_flops"] for p in ("forward", "backward")]
        fp8 = phases["forward"]["fp8_flops"] + phases["backward"]["fp8_flops"]
        assert (fp8 == 0) == (level == "O0"), (level, fp8)
    assert all(gemm[level] == gemm["O0"] for level in step_model.LEVELS), gemm
    parts = [name for name in record["levels"]["O1"]["phases"] if name.startswith("optimizer: ")]
    assert "optimizer: finite check" in parts and "optimizer: weight store" in parts, parts
    part_ops = sum(record["levels"]["O1"]["phases"][name]["ops"] for name in parts)
    assert part_ops == record["levels"]["O1"]["phases"]["optimizer"]["ops"]
    assert all(r["phases"]["optimizer"]["graph_calls"] == 0 for r in record["levels"].values())  # all eager


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_step_profile_counts_compiled_blocks(level: str) -> None:
    """Blocks compiled as bench/gpt.py compiles them are counted as graph calls (one per
    block, forward and backward) whose GEMMs keep the eager step's FLOPs; at O1 inductor
    fuses the FP8 casts into far fewer kernels and bytes than the eager operations."""
    config = dataclasses.replace(PRESETS["tiny"], n_layer=1)
    counts = {blocks: step_profile.profile(level, config, 2, 0, "all", "compiled", blocks)[0]
              for blocks in ("eager", "compiled")}
    for phase in ("forward", "backward"):
        eager, compiled = counts["eager"][phase], counts["compiled"][phase]
        assert compiled["graph_calls"] == 1 and eager["graph_calls"] == 0, (phase, compiled)
        flops = {blocks: (row[phase]["fp8_flops"], row[phase]["other_flops"]) for blocks, row in counts.items()}
        assert flops["compiled"] == flops["eager"], (phase, flops)
        if level == "O1":
            assert compiled["ops"] + compiled["graph_kernels"] < eager["ops"] / 2, (phase, compiled, eager)
            assert compiled["bytes"] + compiled["graph_bytes"] < eager["bytes"] / 2, (phase, compiled, eager)


def test_step_profile_solves_bilinear_counts_exactly() -> None:
    def f(blocks: int, batch: int) -> float:
        return 7 + 3 * blocks + 5 * batch + 11 * blocks * batch

    points = {point: f(*point) for point in step_profile.GPT_1B_POINTS}
    assert step_profile.solve_bilinear(points, 20, 8) == f(20, 8)


class _GemmBytes(counting.StepCounter):
    """The counter, also summing per phase the bytes it counts for operations with FLOPs."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gemm: dict[str, float] = {}

    def _count(self, name: str | None, **values: float) -> None:
        if values.get("fp8_flops") or values.get("other_flops"):
            moved = values.get("bytes", 0) + values.get("graph_bytes", 0)
            self.gemm[self.current] = self.gemm.get(self.current, 0) + moved
        super()._count(name, **values)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_step_profile_gemm_operand_bytes_are_those_counted(level: str) -> None:
    """The GEMMs' and attention's bytes ``gemm_operand_bytes`` derives from the shapes are
    those the counter counts for them, BF16 or FP8 (within their biases, scales and log-sum-exp)."""
    config, batch = PRESETS["tiny"], 2
    model, optimizer = step_profile.build(level, config, "all", "reference")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=generator)
    step_profile.run_step(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), None)
    counter = _GemmBytes(step_profile.host_scalars(optimizer))
    step_profile.run_step(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), counter)
    derived = step_model.gemm_operand_bytes(config, batch, level, "all")
    for phase in ("forward", "backward"):
        assert derived[phase] == pytest.approx(counter.gemm[phase], rel=0.03), (phase, derived, counter.gemm)
