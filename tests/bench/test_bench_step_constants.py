"""bench/step_constants.py: the step model's constants measured on H100 records, and those of
the committed records reproducing the model's defaults."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench_checks import counts_row
from conftest import load_bench

step_model = load_bench("step_model")
step_constants = load_bench("step_constants")


def _kernel(us: float, calls: float = 1.0) -> dict[str, float]:
    return {"us": us, "calls": calls}


def test_step_constants_measures_bandwidth_and_kernel_cost() -> None:
    """torch's fused AdamW moves 28 bytes per parameter in its kernels' time; a kernel
    that moves next to nothing costs the median of the short calls."""
    record = {"millions": 2, "width": 1024, "rows": [
        {"run": "torch AdamW fused", "kernel_ms": 28 * 2 * 1024**2 / 1e9,  # 1 TB/s
         "kernels": {"adam": _kernel(1000.0), "step": _kernel(3.0, 3)}},
        {"run": "amp8 O1", "kernel_ms": 1.0, "kernels": {"copy": _kernel(2.0), "memset": _kernel(4.0, 2),
                                                         "update": _kernel(900.0)}},
    ]}
    assert step_constants.measured_bandwidth(record) == pytest.approx(1e12)
    assert step_constants.measured_kernel_s(record) == pytest.approx(2e-6)  # of 1, 2 and 2 us


@pytest.mark.parametrize("cost_ps", [0.4, 0.6])
def test_step_constants_measures_the_update_and_eager_kernels(cost_ps: float) -> None:
    """Update kernels that take their graph's bytes at the bandwidth plus ``cost_ps`` per
    integer operation give that cost back per level; the other kernels' time over the eager
    bytes is the eager bandwidth."""
    model = step_model.H100Model(bandwidth=1e12)
    rows, counted = [], []
    for level, ints, graph in (("O1", 1e10, 4e9), ("O2", 3e10, 2e9)):
        update_us = 1e6 * (graph / 1e12 + ints * cost_ps * 1e-12)
        rows.append({"run": f"amp8 {level}", "kernel_ms": 1e-3 * update_us + 2.0,  # 2 ms of eager kernels
                     "kernels": {"triton_red_fused_update_0": _kernel(0.75 * update_us),
                                 "_scatter_gather_elementwise_kernel": _kernel(0.25 * update_us)}})
        counted.append({"millions": 300, "level": level, "stretches": [
            counts_row(nbytes=1e9), {**counts_row(nbytes=0.5e9), "graph_bytes": graph, "int_ops": ints}]})
    record = {"millions": 300, "rows": rows}
    costs = step_constants.measured_int_op_s(model, record, counted)
    assert costs == {"O1": pytest.approx(cost_ps * 1e-12), "O2": pytest.approx(cost_ps * 1e-12)}
    assert step_constants.measured_eager_bandwidth(record, counted) == pytest.approx(1.5e9 / 2e-3)
    with pytest.raises(ValueError, match="no counted optimizer step"):
        step_constants.measured_int_op_s(model, {**record, "millions": 30}, counted)


def test_step_constants_reads_the_gemm_rates_at_the_largest_shapes() -> None:
    record = {"rows": [
        {"flop": 6e9, "variants": {"nn.Linear compiled": {"ms": 1.0}, "Fp8Linear compiled": {"ms": 4.0}}},
        {"flop": 6e12, "variants": {"nn.Linear compiled": {"ms": 10.0}, "Fp8Linear compiled": {"ms": 6.0}}},
        {"flop": 6e12, "variants": {"nn.Linear compiled": {"ms": 14.0}, "Fp8Linear compiled": {"ms": 6.0}}},
    ]}
    assert step_constants.measured_gemm_rates(record) == (pytest.approx(5e14), pytest.approx(1e15))


def test_step_constants_measured_constants_of_the_h100_records_are_physical() -> None:
    """The constants measured on the recorded H100 runs lie under the H100's peaks
    (3.35 TB/s, 989 and 1979 dense TFLOP/s) and match the model's defaults."""
    model, calibrated = step_constants.measured_model(json.loads(step_constants.LINEAR_RECORDED.read_text()),
                                                    json.loads(step_constants.KERNELS_RECORDED.read_text()))
    assert 0.5e12 < model.bandwidth < 3.35e12 and 0.3e15 < model.bf16_rate < model.fp8_rate < 1.979e15
    assert 0.5e-6 < model.kernel_s < 5e-6 and len(calibrated) >= 4
    defaults = step_model.H100Model()
    for name in ("bandwidth", "bf16_rate", "fp8_rate", "kernel_s"):
        assert getattr(model, name) == pytest.approx(getattr(defaults, name), rel=0.01), name


def test_step_constants_of_the_recorded_code_are_the_model_defaults() -> None:
    """The constants measured once with the counts of the code the H100 records ran
    (``RECORDED_CODE``), with which later code is modeled, are the model's defaults within
    their rounding; O0 takes the levels' mean cost of an integer operation."""
    model, models, calibrated = step_constants.fixed_models(json.loads(step_constants.RECORDED_CODE.read_text()))
    defaults = step_model.H100Model()
    for name in ("bandwidth", "eager_bandwidth", "bf16_rate", "fp8_rate", "kernel_s", "int_op_s"):
        assert getattr(model, name) == pytest.approx(getattr(defaults, name), rel=0.01), name
    for name in ("launch_s", "host_op_s", "graph_call_s"):  # assumed, or measured apart: as they are
        assert getattr(model, name) == getattr(defaults, name), name
    assert models["O0"].int_op_s == model.int_op_s
    assert models["O1"].int_op_s < models["O2"].int_op_s < models["O3"].int_op_s
    assert len(calibrated) == 1 and step_constants.RECORDED_CODE.name in calibrated[0], calibrated


def test_step_constants_measured_anew_are_those_of_the_recorded_code() -> None:
    """Measured again from the committed H100 records, with the optimizer-only counts kept
    in ``RECORDED_CODE``, every constant is the one ``--measure`` wrote there."""
    recorded = json.loads(step_constants.RECORDED_CODE.read_text())
    kernels = json.loads(step_constants.KERNELS_RECORDED.read_text())
    model, _ = step_constants.measured_model(json.loads(step_constants.LINEAR_RECORDED.read_text()), kernels)
    model, models, calibrated = step_constants.optimizer_models(model, kernels, recorded["optimizer_check"])
    fixed, fixed_levels, _ = step_constants.fixed_models(recorded)
    assert dataclasses.asdict(model) == pytest.approx(dataclasses.asdict(fixed), rel=1e-9)
    assert {level: m.int_op_s for level, m in models.items()} == pytest.approx(
        {level: m.int_op_s for level, m in fixed_levels.items()}, rel=1e-9)
    assert len(calibrated) == 2, calibrated
