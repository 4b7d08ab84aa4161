"""The H100 step model's constants, measured on the recorded H100 runs in bench/results/
(no constant is fitted to bench/results/gpt-cuda.json, the step the model predicts;
the JSON's ``h100_model.calibrated`` says which comes from which):
- GEMMs: ``nn.Linear`` and ``Fp8Linear`` compiled, forward + backward, at the largest shapes
  of linear-cuda.json (644 and 890 TFLOP/s, their casts included; gpt-1b's GEMMs, 4-16x
  fewer FLOPs each, are not recorded);
- bandwidth: torch's fused AdamW's kernels at 300M parameters (optimizer_kernels-cuda.json,
  2.71 TB/s), 28 bytes a parameter, of which the counter sees the 16 read
  (``step_model.add_modeled_bytes`` adds the 12 written); the aten kernels of amp8's
  optimizer step (FP8 gradients copied, their bytes' maxima) move 1.09 TB/s there;
- integer operations: amp8's update kernels beyond their bytes, per level (0.40-0.63 ps);
- kernels: 1.5 us, the median small kernel of those steps; graph calls 0.45 ms of host.
They are measured once, with the counts of the code the H100 records ran
(``RECORDED_CODE``: ``python bench/step_profile.py --preset gpt-1b --measure``), and later
code is modeled with them unchanged (``fixed_models``), so that a change of the code, not
of the model, moves its modeled time.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from records import RESULTS
from step_model import ADAMW_READ, ADAMW_WRITTEN, LEVELS, H100Model

# The H100 records (bench/results/) the model is checked against and measured on:
RECORDED = RESULTS / "gpt-cuda.json"  # the gpt-1b steps the predictions are checked against
OPTIMIZER_RECORDED = RESULTS / "optimizer-cuda.json"  # amp8's optimizer-only steps: the optimizer check
KERNELS_RECORDED = RESULTS / "optimizer_kernels-cuda.json"  # the same steps' kernels, and torch's fused AdamW's
LINEAR_RECORDED = RESULTS / "linear-cuda.json"  # one layer's forward + backward, nn.Linear and Fp8Linear
# The gpt-1b counts of the code the H100 records ran (``--measure``), and the constants
# measured with them: later code is modeled with these constants, unchanged, so that a
# change of the code, not of the model, moves its modeled time.
RECORDED_CODE = RESULTS / "step_profile-recorded-code-cpu.json"
SMALL_KERNEL_S = 5e-6  # a recorded kernel call shorter than this moves next to nothing (``measured_kernel_s``)


def measured_gemm_rates(record: dict[str, Any]) -> tuple[float, float]:
    """(BF16, FP8) GEMM FLOP/s from a bench/linear.py CUDA record: a layer's forward +
    backward FLOPs over the recorded ms of ``nn.Linear`` compiled (BF16 autocast) and of
    ``Fp8Linear`` compiled, summed over the rows of the most FLOPs (4096 x 8192 x 16384 and
    8192^3, where launches are no part of a layer's time). The layer's casts are in it, so
    this is a lower bound of the GEMMs' own rate: by their bytes, the weight's cast and its
    gradient's take 7-12 % of nn.Linear's time there, the input's and the output gradient's
    4-6 % of Fp8Linear's."""
    most = max(row["flop"] for row in record["rows"])
    rows = [row for row in record["rows"] if row["flop"] == most]

    def rate(variant: str) -> float:
        return sum(row["flop"] for row in rows) / (1e-3 * sum(row["variants"][variant]["ms"] for row in rows))

    return rate("nn.Linear compiled"), rate("Fp8Linear compiled")


def _record_parameters(record: dict[str, Any]) -> int:
    """Parameters of a bench/optimizer_kernels.py record's runs (square layers, as
    ``optimizer.square_layers`` builds them)."""
    width = record["width"]
    return max(1, round(record["millions"] * 1_000_000 / width**2)) * width**2


def measured_bandwidth(record: dict[str, Any]) -> float:
    """B/s of torch's fused AdamW in a bench/optimizer_kernels.py CUDA record:
    ``ADAMW_READ + ADAMW_WRITTEN`` bytes per float32 parameter over its kernels' time."""
    row = next(row for row in record["rows"] if row["run"] == "torch AdamW fused")
    return (ADAMW_READ + ADAMW_WRITTEN) * _record_parameters(record) / (1e-3 * row["kernel_ms"])


def measured_kernel_s(record: dict[str, Any]) -> float:
    """GPU seconds of a kernel that moves next to nothing, from a bench/optimizer_kernels.py
    CUDA record: the median time of the calls shorter than ``SMALL_KERNEL_S`` (scalar
    updates, memsets, small copies and reductions: 0.7-4 us, median 1.5 us on the H100)."""
    calls = [kernel["us"] * 1e-6 / kernel["calls"] for row in record["rows"] for kernel in row["kernels"].values()]
    return statistics.median(seconds for seconds in calls if seconds < SMALL_KERNEL_S)


def measured_model(linear: dict[str, Any], kernels: dict[str, Any]) -> tuple[H100Model, list[str]]:
    """The model with the constants measured on the H100 records ``linear`` (bench/linear.py)
    and ``kernels`` (bench/optimizer_kernels.py), and where each comes from."""
    bf16_rate, fp8_rate = measured_gemm_rates(linear)
    model = H100Model(bandwidth=measured_bandwidth(kernels), bf16_rate=bf16_rate, fp8_rate=fp8_rate,
                      kernel_s=measured_kernel_s(kernels))
    return model, [
        f"bandwidth: torch's fused AdamW kernels, {ADAMW_READ + ADAMW_WRITTEN} bytes per parameter, "
        f"{KERNELS_RECORDED.name}",
        f"bf16_rate, fp8_rate: nn.Linear and Fp8Linear compiled, forward + backward at the largest shapes, "
        f"{LINEAR_RECORDED.name}",
        f"kernel_s: the median kernel shorter than {SMALL_KERNEL_S * 1e6:.0f} us, {KERNELS_RECORDED.name}",
        "graph_call_s: compiled optimizer-only runs, one graph per tensor, optimizer-per-tensor-cuda.json",
        "launch_s, host_op_s: assumed",
    ]



def update_kernel_seconds(row: dict[str, Any]) -> float:
    """GPU seconds of amp8's compiled update in one amp8 row of a bench/optimizer_kernels.py
    CUDA record: its generated kernels (``triton_``) and the scatter-reduce it falls back
    to (the per-tensor maxima, ``_scatter_gather``); the rest are the step's eager kernels."""
    return 1e-6 * sum(kernel["us"] for name, kernel in row["kernels"].items()
                      if name.startswith("triton_") or "_scatter_gather" in name)


def _counted_steps(record: dict[str, Any],
                   counted: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The amp8 rows of a bench/optimizer_kernels.py CUDA record, each with the counts of the
    same optimizer-only step among ``counted`` (``step_profile.optimizer_check_counts`` rows)."""
    pairs = []
    for row in record["rows"]:
        run = next((run for run in counted if f"amp8 {run['level']}" == row["run"]
                    and run["millions"] == record["millions"]), None)
        if run is not None:
            pairs.append((row, run))
    if not pairs:
        raise ValueError(f"no counted optimizer step matches an amp8 row of {KERNELS_RECORDED.name} "
                         f"({record['millions']}M): count those steps (optimizer_check_counts)")
    return pairs


def measured_eager_bandwidth(record: dict[str, Any], counted: list[dict[str, Any]]) -> float:
    """B/s of the aten kernels of amp8's optimizer steps (FP8 gradients copied by
    multi-tensor kernels, maxima of their bytes), from a bench/optimizer_kernels.py CUDA
    record and the counts of the same steps (``counted``): their eager bytes over the time of
    the kernels that are not the update's (``update_kernel_seconds``), pooled over the levels
    (1.09-1.10 TB/s at each of O1-O3 on the H100)."""
    pairs = _counted_steps(record, counted)
    moved = sum(stretch["bytes"] for _, run in pairs for stretch in run["stretches"])
    return moved / sum(1e-3 * row["kernel_ms"] - update_kernel_seconds(row) for row, _ in pairs)


def measured_int_op_s(model: H100Model, record: dict[str, Any], counted: list[dict[str, Any]]) -> dict[str, float]:
    """GPU seconds per integer element operation of amp8's compiled update at each level,
    from the update's kernels in a bench/optimizer_kernels.py CUDA record
    (``update_kernel_seconds``) and the counts of the same steps (``counted``): the kernels'
    time beyond the update graph's bytes at ``model.bandwidth``, over its integer operations.
    The levels' updates differ by more than their counted operations: 0.40, 0.52 and
    0.63 ps at O1, O2 and O3 on the H100, with O2 and O3 counted alike."""
    costs = {}
    for row, run in _counted_steps(record, counted):
        update = run["stretches"][-1]  # the update runs after the finite check's sync
        costs[run["level"]] = (update_kernel_seconds(row) - update["graph_bytes"] / model.bandwidth) / update["int_ops"]
    return costs


def fixed_models(record: dict[str, Any]) -> tuple[H100Model, dict[str, H100Model], list[str]]:
    """The model with the constants measured once in ``record`` (a ``--measure`` record,
    ``RECORDED_CODE``), its integer operations at the mean of the levels'; each level's
    model; and where the constants come from."""
    measured = record["h100_model"]
    constants = {key: value for key, value in measured.items() if key not in ("calibrated", "int_op_s")}
    costs = measured["int_op_s"]
    model = dataclasses.replace(H100Model(**constants), int_op_s=statistics.fmean(costs.values()))
    models = {level: dataclasses.replace(model, int_op_s=costs[level]) for level in LEVELS}
    return model, models, [f"every constant as measured in {RECORDED_CODE.name} (--measure measures them anew): "
                           + "; ".join(measured["calibrated"])]


def optimizer_models(model: H100Model, kernels: dict[str, Any],
                     counted: list[dict[str, Any]]) -> tuple[H100Model, dict[str, H100Model], list[str]]:
    """``model`` with the constants measured on amp8's optimizer-only steps of the
    bench/optimizer_kernels.py CUDA record ``kernels``, with the counts of the same steps
    (``counted``): the eager bandwidth, and the integer operations' cost per level (O0, whose
    few integer operations are the embedding's indices, and the returned model at the mean);
    each level's model; and where the two constants come from."""
    model = dataclasses.replace(model, eager_bandwidth=measured_eager_bandwidth(kernels, counted))
    costs = measured_int_op_s(model, kernels, counted)
    model = dataclasses.replace(model, int_op_s=statistics.fmean(costs.values()))
    models = {level: dataclasses.replace(model, int_op_s=costs.get(level, model.int_op_s)) for level in LEVELS}
    return model, models, [
        f"eager_bandwidth: amp8's optimizer steps at {kernels['millions']}M parameters, their kernels other than "
        f"the update's, {KERNELS_RECORDED.name} with the counts of optimizer_check",
        f"int_op_s: amp8's update kernels at {kernels['millions']}M parameters beyond their bytes, per level "
        f"(O0: the mean), {KERNELS_RECORDED.name} with the counts of optimizer_check",
    ]
