"""FP8-LM's automatic pre-scaling against amp8's per-piece scales (studies/prescale.py): a
power-of-two factor is a bit-exact no-op for amp8, the factor follows the paper's rule,
the single-process simulation is amp8's own all-reduce, and the study writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import multiprocess
from amp8.config.formats import E4M3, E5M2
from amp8.distributed import fp8_all_reduce_mean
from amp8.distributed.fp8_collectives import _quantize_pieces
from amp8.distributed.layout import ShardLayout
from amp8.quant import scaling
from conftest import assert_bitwise_equal, load_study

prescale = load_study("prescale")

POWERS_OF_TWO = (2.0**-12, 2.0**-5, 0.5, 2.0, 2.0**7)
NUMEL = 2**14


def _gradients(regime: str, ranks: int, numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    return prescale.gradients(regime, ranks, numel, torch.Generator().manual_seed(seed))


def _blocks(seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, heavy tails included, so every row gets its own
    scale and the scales span many powers of two."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(8, 257, generator=generator) * torch.logspace(-6, 3, 8)[:, None]
    rows[3] = rows[3] / torch.rand(257, generator=generator).clamp_min(1e-3)
    rows[5, :100] = 0.0
    return rows


# -- a power-of-two factor is a no-op for per-piece scales ---------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("factor", POWERS_OF_TWO)
def test_power_of_two_factor_leaves_per_piece_quantization_bit_identical(factor: float, dtype: torch.dtype) -> None:
    x = _blocks()
    scale = scaling.scale_from_amax(x.abs().amax(dim=1), dtype)[:, None]
    scaled_scale = scaling.scale_from_amax((x * factor).abs().amax(dim=1), dtype)[:, None]
    assert_bitwise_equal(scaled_scale, scale / factor)
    data = scaling.quantize(x, scale, dtype)
    assert_bitwise_equal(scaling.quantize(x * factor, scaled_scale, dtype), data)
    undone = scaling.dequantize(scaling.quantize(x * factor, scaled_scale, dtype), scaled_scale) / factor
    assert_bitwise_equal(undone, scaling.dequantize(data, scale))


@pytest.mark.parametrize("factor", POWERS_OF_TWO)
def test_power_of_two_factor_leaves_the_wire_pieces_bit_identical(factor: float) -> None:
    layout = ShardLayout((1000, 37, 4096), 4)
    flats = [row[: numel] for row, numel in zip(_blocks()[[0, 3, 7]].repeat(1, 16), layout.numels)]
    data, scales = _quantize_pieces(layout.pack(flats), layout)
    scaled_data, scaled_scales = _quantize_pieces(layout.pack([flat * factor for flat in flats]), layout)
    assert_bitwise_equal(scaled_data, data)
    assert_bitwise_equal(scaled_scales, scales / factor)


@pytest.mark.parametrize("regime", prescale.REGIMES)
@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_power_of_two_factor_leaves_amp8_all_reduce_bit_identical(regime: str, ranks: int) -> None:
    grads = _gradients(regime, ranks, 999)
    grads[:, :130] = 0.0  # whole zero pieces: their scale falls back to 1 either way
    plain = prescale.amp8_mean(grads)
    for factor in POWERS_OF_TWO:
        assert_bitwise_equal(prescale.amp8_mean(grads, factor).mean, plain.mean)


def test_a_factor_that_is_not_a_power_of_two_changes_bits() -> None:
    grads = _gradients("gaussian", 4, 999)
    assert not torch.equal(prescale.amp8_mean(grads, 1 / 3).mean, prescale.amp8_mean(grads).mean)


# -- the simulation is amp8's all-reduce -----------------------------------------------------
def _amp8_all_reduce(rank: int, world: int, grads: torch.Tensor) -> torch.Tensor:
    return fp8_all_reduce_mean([grads[rank].clone()])[0]


@pytest.mark.multiprocess
def test_simulated_all_reduce_is_bit_identical_to_amp8s_on_two_processes(tmp_path: Path) -> None:
    grads = _gradients("student-t3", 2, 1001)
    results = multiprocess.run(_amp8_all_reduce, tmp_path, grads, world=2)
    simulated = prescale.amp8_mean(grads).mean
    for result in results:
        assert_bitwise_equal(result, simulated)


# -- FP8-LM's automatic scaling rule ---------------------------------------------------------
@pytest.mark.parametrize("factor", [1.0, 0.25, 2.0**-10])
@pytest.mark.parametrize("saturated", [1.1e-5, 1e-3, 0.5])
def test_factor_halves_above_a_thousandth_of_a_percent(factor: float, saturated: float) -> None:
    assert prescale.next_factor(factor, 999, saturated) == (factor / 2, 0)


@pytest.mark.parametrize("saturated", [0.0, 1e-6, 1e-5])
def test_factor_holds_at_or_below_the_threshold(saturated: float) -> None:
    assert prescale.next_factor(0.25, 7, saturated) == (0.25, 8)


def test_factor_doubles_after_growth_interval_clean_steps_up_to_one() -> None:
    policy = prescale.ScalingPolicy()
    factor, clean = 0.25, 0
    history = []
    for _ in range(3 * policy.growth_interval):
        factor, clean = prescale.next_factor(factor, clean, 0.0, policy)
        history.append(factor)
    interval = policy.growth_interval
    assert history[interval - 2] == 0.25 and history[interval - 1] == 0.5
    assert history[2 * interval - 2] == 0.5 and history[2 * interval - 1] == 1.0
    assert history[-1] == 1.0  # capped


def test_a_saturated_step_restarts_the_clean_count() -> None:
    policy = prescale.ScalingPolicy(growth_interval=3)
    factor, clean = 0.5, 0
    for saturated, expected in [(0, 0.5), (0, 0.5), (1e-4, 0.25), (0, 0.25), (0, 0.25), (0, 0.5)]:
        factor, clean = prescale.next_factor(factor, clean, saturated, policy)
        assert factor == expected


def test_factor_stops_at_its_floor() -> None:
    policy = prescale.ScalingPolicy()
    assert prescale.next_factor(policy.min_factor, 0, 1.0, policy) == (policy.min_factor, 0)


def test_clip_limit_is_the_max_plus_half_the_top_step() -> None:
    assert prescale.clip_limit(E4M3) == 448 + 16
    assert prescale.clip_limit(E5M2) == 57344 + 4096
    below = torch.tensor([448.0, prescale.clip_limit(E4M3)])
    assert torch.equal(below.to(E4M3).float(), torch.tensor([448.0, 448.0]))


# -- saturation: shared-scale FP8 sum against amp8 -------------------------------------------
@pytest.mark.parametrize("regime", prescale.REGIMES)
@pytest.mark.parametrize("ranks", [2, 8, 32])
def test_amp8_never_saturates_and_keeps_25_db(regime: str, ranks: int) -> None:
    grads = _gradients(regime, ranks)
    metrics = prescale.measure(grads.double().mean(dim=0), prescale.amp8_mean(grads))
    assert metrics.saturated == 0.0
    assert metrics.sqnr_db >= 25.0, metrics


@pytest.mark.parametrize("ranks", [2, 8, 32])
def test_shared_scale_sum_of_comparable_ranks_saturates_without_prescaling(ranks: int) -> None:
    grads = _gradients("gaussian", ranks)
    reference = grads.double().mean(dim=0)
    shared = prescale.measure(reference, prescale.shared_ring_mean(grads))
    divided = prescale.measure(reference, prescale.shared_ring_mean(grads, 1.0 / ranks))
    assert shared.saturated > 0.0 and divided.saturated == 0.0
    assert divided.sqnr_db > shared.sqnr_db


@pytest.mark.parametrize("ranks", [2, 8, 32])
def test_loud_rank_sets_the_shared_scale_so_its_sum_does_not_clip(ranks: int) -> None:
    """One rank 100x louder: its amax is the shared scale's, the quiet ranks add too little
    to push a partial sum past the rounding limit (464), and nothing clips; the quiet
    ranks' small values are flushed to zero instead, far more often than amp8 flushes."""
    grads = _gradients("loud-rank", ranks)
    reference = grads.double().mean(dim=0)
    shared = prescale.measure(reference, prescale.shared_ring_mean(grads))
    amp8 = prescale.measure(reference, prescale.amp8_mean(grads))
    assert shared.saturated == 0.0 and amp8.saturated == 0.0
    assert shared.flushed > amp8.flushed
    assert amp8.sqnr_db >= 25.0


def test_automatic_factor_stops_the_saturation_over_steps() -> None:
    case = prescale.run_case("gaussian", 16, NUMEL, steps=6, seed=0)
    per_step = case["schemes"]["shared + mu"]["per_step"]["saturated"]
    assert per_step[0] > 1e-5 and per_step[-1] == 0.0
    assert case["mu_per_step"][0] == 1.0 and case["mu_per_step"][-1] < 1.0
    assert case["amp8_prescaled_bit_identical"]


# -- the study end to end --------------------------------------------------------------------
def test_study_runs_end_to_end_and_writes_json(tmp_path: Path) -> None:
    path = prescale.main(["--ranks", "2", "3", "--numel", "1000", "--steps", "3", "--out", str(tmp_path)])
    assert path == tmp_path / "prescale-cpu.json"
    record = json.loads(path.read_text())
    assert record["benchmark"] == "prescale" and record["torch"] == torch.__version__
    assert {"device", "date", "policy", "cases"} <= set(record)
    assert [(case["regime"], case["ranks"]) for case in record["cases"]] == [
        (regime, ranks) for regime in prescale.REGIMES for ranks in (2, 3)]
    for case in record["cases"]:
        assert set(case["schemes"]) == set(prescale.SCHEMES) and len(case["mu_per_step"]) == 3
        assert case["amp8_prescaled_bit_identical"]
        for scheme in case["schemes"].values():
            assert len(scheme["per_step"]["sqnr_db"]) == 3
            assert 0.0 <= scheme["saturated_fraction"] <= 1.0 and 0.0 <= scheme["zeroed_fraction"] <= 1.0
