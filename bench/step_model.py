"""The H100 model of a training step: the counts of ``counting.StepCounter`` (which
bench/step_profile.py takes for a GPT step) turned into milliseconds on two clocks.

``H100Model`` keeps two clocks, host and GPU, over the step's stretches and joins them at
each sync and at the step's end. On the GPU the GEMMs and attention take their FLOPs'
time (their operands move meanwhile: ``gemm_operand_bytes``), every other byte moves at a
bandwidth, each kernel costs a little more, and the stochastic rounding's integer
operations a fixed time each. Its constants are measured on the recorded H100 runs
(``step_constants``), never fitted to the step it predicts (bench/results/gpt-cuda.json,
``predictions``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from amp8.nn.selection import DEFAULT_RULES
from amp8.tools.experiments.gpt import GPTConfig
from counting import COUNTS, PHASES

LEVELS = ("O0", "O1", "O2", "O3")

# Host seconds per compiled-graph call on the recorded H100 machine, beyond its kernel
# launches: the six compiled optimizer-only runs of one graph per tensor (O1-O3, 30M and
# 300M parameters; bench/results/optimizer-per-tensor-cuda.json) spend 0.28-0.64 ms per
# graph call more than their counted launches and bytes, 0.45 ms on average; one number
# for every level and size.
GRAPH_CALL_S = 0.45e-3
# Bytes per float32 parameter of torch's fused AdamW (``_fused_adamw_``): it reads the
# parameter, its gradient and both moments, and writes the parameter and both moments in
# place. It returns nothing, so the counter sees the 16 read and none of the 12 written.
ADAMW_READ, ADAMW_WRITTEN = 16, 12


@dataclasses.dataclass(frozen=True)
class H100Model:
    """Two clocks, as a CUDA step runs: the host queues kernels and runs ahead while the GPU
    works through them, and waits for the GPU only at a sync.

    host time = eager ops * launch_s + host_ops * host_op_s
                + graph_calls * graph_call_s + graph_kernels * launch_s
    GPU time  = (eager ops + graph_kernels) * kernel_s
                + (bytes + graph_bytes + unseen_writes - gemm_bytes - amp8_eager_bytes) / bandwidth
                + amp8_eager_bytes / eager_bandwidth
                + fp8_flops / fp8_rate + other_flops / bf16_rate + int_ops * int_op_s
    ``gemm_bytes``, ``unseen_writes`` and ``amp8_eager_bytes`` are bytes that the counter
    cannot tell apart or does not see, set by ``add_modeled_bytes``: the GEMMs' and
    attention's operands, which move while they compute; torch's fused AdamW's writes; the
    bytes of the aten kernels amp8's optimizer step launches, which run slower than the
    rest. ``step_seconds`` runs both clocks over a step's stretches between syncs
    (``counting.StepCounter.stretches``); ``phase_seconds`` reads each phase's time off the
    GPU's clock, as CUDA events recorded between the phases do.

    The defaults are the H100 measurements ``step_constants.measured_model`` and
    ``step_constants.measured_int_op_s`` read from bench/results/ (rounded; ``int_op_s`` the
    mean of the levels'), except ``launch_s`` and ``host_op_s``, which no record measures."""

    # GPU: bytes of the memory-bound kernels; torch's fused AdamW's kernels at 300M
    # parameters (``step_constants.measured_bandwidth``, optimizer_kernels-cuda.json).
    bandwidth: float = 2.71e12
    # GPU: bytes of the aten kernels amp8's optimizer step launches (multi-tensor copies of
    # FP8 gradients, maxima of their bytes): the amp8 steps' kernels other than the update's
    # at 300M parameters (``step_constants.measured_eager_bandwidth``, optimizer_kernels-cuda.json).
    eager_bandwidth: float = 1.09e12
    # GPU: GEMM FLOP/s, BF16 and FP8: nn.Linear and Fp8Linear forward + backward, compiled,
    # at linear-cuda.json's largest shapes (``step_constants.measured_gemm_rates``); GPT
    # attention runs at the BF16 rate.
    bf16_rate: float = 644e12
    fp8_rate: float = 890e12
    # Host: Python and torch's dispatch of one operation plus cudaLaunchKernel, eager or
    # from inductor's wrapper; the GPU does not wait for it while it has queued work. Assumed.
    launch_s: float = 6e-6
    # Host: an operation on CPU scalars (the optimizer's step counts): dispatch, no launch. Assumed.
    host_op_s: float = 3e-6
    # Host: one compiled-graph call beyond its kernel launches: dynamo's guards on its
    # inputs, the AOT wrapper, and the caller's Python that prepares it.
    graph_call_s: float = GRAPH_CALL_S
    # GPU: what a kernel costs beyond its bytes and FLOPs: the median kernel that moves next
    # to nothing in optimizer_kernels-cuda.json (``step_constants.measured_kernel_s``).
    kernel_s: float = 1.5e-6
    # GPU: one integer element operation (the stochastic rounding's 32-bit hash, in int64
    # words in the compiled update: an H100 has no native int64 multiply); the update graph's
    # kernels in optimizer_kernels-cuda.json beyond their bytes, per level (``step_constants.measured_int_op_s``).
    int_op_s: float = 0.52e-12

    def host_seconds(self, counts: dict[str, float]) -> float:
        """Host time of ``counts``."""
        return (counts["ops"] * self.launch_s + counts.get("host_ops", 0) * self.host_op_s
                + counts.get("graph_calls", 0) * self.graph_call_s + counts.get("graph_kernels", 0) * self.launch_s)

    def device_seconds(self, counts: dict[str, float]) -> float:
        """GPU time of ``counts``."""
        slow = counts.get("amp8_eager_bytes", 0)
        moved = (counts["bytes"] + counts.get("graph_bytes", 0) + counts.get("unseen_writes", 0)
                 - counts.get("gemm_bytes", 0) - slow)
        return ((counts["ops"] + counts.get("graph_kernels", 0)) * self.kernel_s
                + moved / self.bandwidth + slow / self.eager_bandwidth
                + counts["fp8_flops"] / self.fp8_rate + counts["other_flops"] / self.bf16_rate
                + counts.get("int_ops", 0) * self.int_op_s)

    def _clocks(self, stretches: list[Stretch]) -> list[tuple[float, float]]:
        """(host, GPU) clock before the first stretch and after each. Within a stretch the
        GPU runs what the host queued, never before the host queued it: it ends at the
        later of its own clock plus the stretch's GPU time and the host's clock. A sync
        joins the clocks (the host waits for the GPU); so does the step's end (the loss read)."""
        host = device = 0.0
        clocks = [(host, device)]
        for _, counts, sync in stretches:
            start = host
            host += self.host_seconds(counts)
            device = max(max(device, start) + self.device_seconds(counts), host)
            if sync:
                host = device = max(host, device)
            clocks.append((host, device))
        return clocks

    def step_seconds(self, stretches: list[Stretch]) -> float:
        """Time of a step from a sync to a sync: ``stretches`` (phase, counts, whether a sync
        ends it) in the order they run."""
        host, device = self._clocks(stretches)[-1]
        return max(host, device)

    def phase_seconds(self, stretches: list[Stretch], phases: tuple[str, ...]) -> float:
        """GPU-clock time from the start of the first of ``phases`` to the end of the last,
        as two CUDA events recorded there measure it: an event completes when the host has
        recorded it and the GPU has finished the work queued before it."""
        clocks = self._clocks(stretches)
        inside = [i for i, (phase, _, _) in enumerate(stretches) if phase in phases]
        (start_host, start_device), (end_host, end_device) = clocks[inside[0]], clocks[inside[-1] + 1]
        return max(end_host, end_device) - max(start_host, start_device)


Stretch = tuple[str, dict[str, float], bool]  # (phase, counts, whether a sync ends it)


def step_stretches(result: dict[str, Any]) -> list[Stretch]:
    """A level's stretches between syncs in the order they run, for ``H100Model.step_seconds``:
    each phase's ``stretches`` where counted (all but the last end with a sync), else the
    phase as one stretch that ends with a sync if it made one."""
    out: list[Stretch] = []
    for phase in PHASES:
        stretches = result.get("stretches", {}).get(phase)
        if stretches is None:
            row = result["phases"][phase]
            out.append((phase, row, row["syncs"] > 0))
        else:
            out.extend((phase, counts, i < len(stretches) - 1) for i, counts in enumerate(stretches))
    return out



def gemm_operand_bytes(config: GPTConfig, batch_size: int, level: str, layer_selection: str) -> dict[str, float]:
    """Bytes the GEMMs and attention of one GPT step (``config``, ``batch_size`` sequences)
    read and write, per phase, as the counter counts them in ``bytes`` and ``graph_bytes``:
    each GEMM's two operands and its output (forward; the data- and weight-gradient GEMMs
    backward) and attention's q, k, v and output (forward; those, the output's gradient and
    the three gradients backward). On an H100 every GEMM and attention of these shapes is
    compute-bound: its bytes move while it computes, in the time its FLOPs take, so the model
    takes them out of the bytes it puts at bandwidth. Operands are FP8 (1 byte) in the layers
    amp8 runs in FP8 at ``level`` under ``layer_selection`` ("cuda": amp8's CUDA speed rule,
    else every layer), BF16 (2 bytes, autocast) elsewhere; outputs are BF16. The head, tied to
    the embedding, is a BF16 GEMM. The counter attributes a little more to these operations
    (their biases, scales and attention's log-sum-exp: 0.1 % at gpt-1b's width)."""
    tokens, width = batch_size * config.block_size, config.n_embd
    rule = DEFAULT_RULES["cuda"] if layer_selection == "cuda" else None
    block = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]  # (in, out): qkv, proj, MLP
    layers = [(k, n, level != "O0" and (rule is None or rule.selects(k, n))) for k, n in block] * config.n_layer
    forward = backward = 0
    for k, n, fp8 in layers + [(width, config.vocab_size, False)]:
        size = 1 if fp8 else 2
        forward += size * (tokens * k + k * n) + 2 * tokens * n  # y = x W
        backward += size * (tokens * n + k * n) + 2 * tokens * k  # dx = dy W^T
        backward += size * (tokens * n + tokens * k) + 2 * k * n  # dW = dy^T x
    attention = 2 * tokens * width * config.n_layer  # one of q, k, v, output (or a gradient) per block, BF16
    return {"forward": forward + 4 * attention, "backward": backward + 8 * attention}


def add_modeled_bytes(level: str, result: dict[str, Any], gemm_bytes: dict[str, float]) -> None:
    """Set on ``result`` (a level's ``phases``, their parts and ``stretches``, in place) the
    byte counts the model needs that the counter cannot give:
    - ``gemm_bytes``: the GEMMs' and attention's bytes per phase (``gemm_operand_bytes``),
      over a phase's stretches in proportion to their GEMM FLOPs;
    - ``unseen_writes``: the ``ADAMW_WRITTEN`` bytes torch's fused AdamW writes for each
      ``ADAMW_READ`` it is counted with, where it runs: the whole optimizer step at O0,
      amp8's plain step (float32 parameters) at O1-O3, in the optimizer's last stretch
      (after the finite check's sync);
    - ``amp8_eager_bytes``: at O1-O3, the bytes of the optimizer's eager operations other
      than torch's fused AdamW (amp8's finite check, gradient copy, weight stores).
    Setting them again (counts modeled anew) gives the same values."""
    phases, stretches = result["phases"], result["stretches"]
    for phase in PHASES:
        flops = [s["fp8_flops"] + s["other_flops"] for s in stretches[phase]]
        phases[phase]["gemm_bytes"] = gemm_bytes[phase] if phase in gemm_bytes and sum(flops) else 0
        for stretch, share in zip(stretches[phase], flops, strict=True):
            stretch["gemm_bytes"] = phases[phase]["gemm_bytes"] * share / sum(flops) if share else 0
    torch_step = "optimizer" if level == "O0" else "optimizer: plain step"  # the row torch's fused AdamW runs in
    adamw = phases.get(torch_step, {}).get("bytes", 0)
    optimizer = stretches["optimizer"]
    for i, stretch in enumerate(optimizer):
        last = i == len(optimizer) - 1
        stretch["unseen_writes"] = adamw * ADAMW_WRITTEN / ADAMW_READ if last else 0
        stretch["amp8_eager_bytes"] = 0 if level == "O0" else stretch["bytes"] - (adamw if last else 0)
    for name, row in phases.items():
        if name.startswith("optimizer"):
            adamw_row = level == "O0" or name == torch_step
            row["unseen_writes"] = row["bytes"] * ADAMW_WRITTEN / ADAMW_READ if adamw_row else 0
            row["amp8_eager_bytes"] = 0 if adamw_row else row["bytes"]
    phases["optimizer"].update({key: sum(stretch[key] for stretch in optimizer)
                                for key in ("unseen_writes", "amp8_eager_bytes")})


def compiled_row(recorded: dict[str, Any], run: str) -> dict[str, Any]:
    """The compiled row of ``run`` in a bench/gpt.py record (``{}`` where it has none);
    records written before the eager rows hold the compiled row under the run alone."""
    row = recorded["runs"].get(run, {})
    return row.get("compiled", row)


RECORDED_RUNS = {"O0": "baseline", "O1": "amp8 O1", "O2": "amp8 O2", "O3": "amp8 O3"}
# Timed quantities of a bench/gpt.py record: (name there, the phases it spans, or none for the step)
TIMED = (("step_ms", ()), ("forward_backward_ms", ("forward", "backward")), ("optimizer_ms", ("optimizer",)))


def predictions(results: dict[str, Any], models: dict[str, H100Model], recorded: dict[str, Any]) -> dict[str, Any]:
    """Modeled gpt-1b ms per level (each by its model in ``models``) against the recorded
    ones: the step, forward+backward and the optimizer (on the GPU's clock, as the recorded
    CUDA events), with each phase's host and GPU time."""
    out = {}
    for level, result in results.items():
        model = models[level]
        stretches = step_stretches(result)
        run = compiled_row(recorded, RECORDED_RUNS[level])
        row: dict[str, Any] = {"phases_ms": {p: {"host_ms": 1e3 * model.host_seconds(result["phases"][p]),
                                                 "gpu_ms": 1e3 * model.device_seconds(result["phases"][p])}
                                             for p in PHASES}}
        for name, phases in TIMED:
            modeled = 1e3 * (model.phase_seconds(stretches, phases) if phases else model.step_seconds(stretches))
            row[name] = {"modeled": modeled}
            if name in run:
                row[name].update(recorded=run[name], error_pct=100 * (modeled / run[name] - 1))
        out[level] = row
    return out



def optimizer_check(models: dict[str, H100Model], counted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The modeled compiled optimizer step (wall clock, sync to sync) against
    bench/optimizer.py's H100 timings (``amp8_fused_ms``) for the counts of
    ``step_profile.optimizer_check_counts``, each level by its model in ``models``; every eager byte of
    these steps is amp8's (``amp8_eager_bytes``)."""
    rows = []
    for run in counted:
        total = {key: sum(stretch[key] for stretch in run["stretches"]) for key in COUNTS}
        last = len(run["stretches"]) - 1
        stretches = [("optimizer", {**counts, "amp8_eager_bytes": counts["bytes"]}, i < last)
                     for i, counts in enumerate(run["stretches"])]
        modeled = 1e3 * models[run["level"]].step_seconds(stretches)
        rows.append({**run, "graph_calls": total["graph_calls"], "graph_kernels": total["graph_kernels"],
                     "graph_gb": total["graph_bytes"] / 1e9, "eager_ops": total["ops"], "int_ops": total["int_ops"],
                     "modeled_ms": modeled, "error_pct": 100 * (modeled / run["recorded_ms"] - 1)})
    return rows
