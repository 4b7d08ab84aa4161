"""bench/step_model.py: the host and GPU clocks over a step's stretches, a sync joining them,
the phases on the GPU's clock, the bytes the counter cannot give."""

from __future__ import annotations

from typing import Any

import pytest

from bench_checks import counts_row
from conftest import load_bench

step_model = load_bench("step_model")


@pytest.mark.parametrize("layout", ["per mode", "compiled only"])
def test_step_model_reads_the_compiled_row_of_either_gpt_record(layout: str) -> None:
    compiled, eager = {"step_ms": 110.0}, {"step_ms": 180.0}
    run = {"compiled": compiled, "eager": eager} if layout == "per mode" else compiled
    record = {"runs": {"baseline": run}}
    assert step_model.compiled_row(record, "baseline") == compiled
    assert step_model.compiled_row(record, "amp8 O3") == {}


# 1 ms of host time per eager op, 1 ms of GPU time per kB; nothing else costs anything.
_MS_MODEL = step_model.H100Model(launch_s=1e-3, kernel_s=0.0, bandwidth=1e6)


@pytest.mark.parametrize("host_ms, gpu_ms", [(10, 2), (2, 10), (5, 5)])
def test_step_model_a_stretch_takes_the_longer_clock(host_ms: int, gpu_ms: int) -> None:
    """One stretch, host-bound or GPU-bound: the host queues while the GPU works."""
    stretch = counts_row(ops=host_ms, nbytes=1000 * gpu_ms)
    assert _MS_MODEL.step_seconds([("forward", stretch, False)]) == pytest.approx(1e-3 * max(host_ms, gpu_ms))


@pytest.mark.parametrize("sync, step_ms", [(False, 10), (True, 20)])
def test_step_model_a_sync_joins_the_clocks(sync: bool, step_ms: int) -> None:
    """GPU work (10 ms) then host work (10 ms): without a sync between them the host's work
    overlaps the GPU's; with one the host waits for the GPU first and the two add up."""
    stretches = [("forward", counts_row(nbytes=10_000), sync), ("optimizer", counts_row(ops=10), False)]
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(1e-3 * step_ms)


def test_step_model_gpu_never_runs_ahead_of_the_host() -> None:
    """Host work (10 ms) then GPU work (10 ms): the GPU gets the second stretch only once the
    host has queued it, so they add up even without a sync."""
    stretches = [("forward", counts_row(ops=10), False), ("backward", counts_row(nbytes=10_000), False)]
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(20e-3)


@pytest.mark.parametrize("host_ms, gpu_ms", [(4, 10), (10, 4)])
def test_step_model_phases_on_the_gpu_clock(host_ms: int, gpu_ms: int) -> None:
    """A phase's CUDA-event time: from when the GPU is done with the work before it (and
    the host has got there) to when it is done with the phase's own. GPU work (``gpu_ms``)
    then host work (``host_ms``) and GPU work (10 ms) after a sync."""
    stretches = [("backward", counts_row(nbytes=1000 * gpu_ms), False),
                 ("optimizer", counts_row(ops=host_ms), True), ("optimizer", counts_row(nbytes=10_000), False)]
    assert _MS_MODEL.phase_seconds(stretches, ("backward",)) == pytest.approx(1e-3 * gpu_ms)
    optimizer = max(host_ms, gpu_ms) - gpu_ms + 10  # the host's launches run on past the backward's GPU work
    assert _MS_MODEL.phase_seconds(stretches, ("optimizer",)) == pytest.approx(1e-3 * optimizer)
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(1e-3 * (max(host_ms, gpu_ms) + 10))


def test_step_model_device_time_of_the_modeled_bytes() -> None:
    """The GEMMs' operand bytes move in their FLOPs' time, torch's fused AdamW's unseen
    writes at the bandwidth, and amp8's eager optimizer bytes at the eager bandwidth."""
    model = step_model.H100Model(bandwidth=1e6, eager_bandwidth=2.5e5, kernel_s=0.0, bf16_rate=1e9)
    counts = {**counts_row(nbytes=3000), "graph_bytes": 5000, "other_flops": 4e6, "gemm_bytes": 2000,
              "unseen_writes": 1000, "amp8_eager_bytes": 500}
    assert model.device_seconds(counts) == pytest.approx(1e-3 * (6.5 + 2 + 4))  # 6,500 B, 500 B slow, 4 MFLOP


def _gpt_result(level: str) -> dict[str, Any]:
    """A level's counts as ``profile`` gives them: the forward and backward with GEMM FLOPs,
    the optimizer split at its finite check's sync, torch's fused AdamW in the last stretch
    (the whole step at O0, amp8's plain step of 16 bytes at O1)."""
    forward = {**counts_row(nbytes=100), "other_flops": 10}
    first, last = counts_row(nbytes=40), counts_row(nbytes=32)
    phases = {"forward": dict(forward), "backward": counts_row(nbytes=50), "optimizer": counts_row(nbytes=72),
              "optimizer: plain step": counts_row(nbytes=16)}
    stretches = {"forward": [dict(forward)], "backward": [counts_row(nbytes=50)],
                 "optimizer": [last] if level == "O0" else [first, last]}
    if level == "O0":
        phases["optimizer"] = counts_row(nbytes=32)
    return {"phases": phases, "stretches": stretches}


@pytest.mark.parametrize("level, writes, amp8_eager", [("O0", 24, [0]), ("O1", 12, [40, 16])])
def test_step_model_adds_the_bytes_the_counter_cannot_give(level: str, writes: float,
                                                              amp8_eager: list[float]) -> None:
    """GEMM bytes go to the stretches with GEMM FLOPs; torch's fused AdamW writes 12 bytes
    for every 16 it is counted with, in the optimizer's last stretch; amp8's eager bytes are
    the rest of the optimizer's; setting them twice (a JSON modeled again) changes nothing."""
    result = _gpt_result(level)
    for _ in range(2):
        step_model.add_modeled_bytes(level, result, {"forward": 60, "backward": 70})
    phases, stretches = result["phases"], result["stretches"]
    assert phases["forward"]["gemm_bytes"] == stretches["forward"][0]["gemm_bytes"] == 60
    assert phases["backward"]["gemm_bytes"] == 0  # no GEMM FLOPs there
    assert [s["unseen_writes"] for s in stretches["optimizer"]][-1] == phases["optimizer"]["unseen_writes"] == writes
    assert [s["amp8_eager_bytes"] for s in stretches["optimizer"]] == amp8_eager
