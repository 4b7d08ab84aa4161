"""Where a GPT training step's time goes: forward, backward and optimizer step counted on
the CPU (aten operations dispatched, bytes they move, GEMM FLOPs, host time), and a
simple H100 model that turns the counts into milliseconds.

    python bench/step_profile.py                     # small preset, O0-O3, about a minute
    python bench/step_profile.py --preset tiny --levels O0 O1
    python bench/step_profile.py --preset gpt-1b     # counts for the recorded H100 run

Each level builds amp8's byte-level GPT (amp8/tools/experiments/gpt.py) from the same
seeded weights and runs under BF16 autocast, as bench/gpt.py runs on CUDA, with each
transformer block compiled as there (``--blocks compiled``, the default for gpt-1b) or
eagerly (``--blocks eager``, the default otherwise): O0 is the baseline (torch AdamW,
fused where the CPU has it, else foreach), O1-O3 are
``amp8.initialize`` with amp8's optimizer step compiled as on CUDA (``--optimizer
compiled``, ``LowBitAdam(fused=True)``) or its eager reference (``--optimizer reference``,
every operation of the update visible). One warm-up step, then ``--steps`` plain steps give the host
time per phase (median), then one step under a ``TorchDispatchMode`` gives the counts:
- ops: aten operations that run a kernel (views, ``detach`` and allocations are left out),
  a proxy for GPU kernel launches in eager mode; host ops: operations on the optimizer's
  step counts, which a CUDA run keeps on the CPU (``host_scalars``), and on what is computed
  from them alone; syncs: ``.item()``-style reads of anything else (a read of a step count
  is none); each phase is also counted in stretches between its syncs (``stretches``);
- bytes: the nbytes of every plain tensor an operation takes plus those it returns, an
  upper bound of its memory traffic (a kernel may read a broadcast operand once, and an
  in-place result is counted as read and written);
- GEMM FLOPs from ``torch.utils.flop_counter``'s formulas: ``_scaled_mm`` as FP8, the
  rest (mm, addmm, bmm, attention) as high precision.
- graph calls: calls of compiled graphs (the blocks' forward and backward, the optimizer's
  update however it groups its parameters), each with the GPU kernels its generated code
  stands for and the bytes those kernels' arguments hold (``compiled_graphs.GraphCalls``);
  the GEMMs and fallbacks a graph calls (``extern_kernels``) are aten operations this mode
  sees: their bytes and FLOPs go to the graph's counts;
- int ops: element operations on int32 and int64 tensors (the stochastic rounding's hash).
  The compiled update's are counted on one more step of the same update run eagerly
  (``add_update_int_ops``).
Inside amp8's optimizer step the operations are split by the amp8 function they run
in (``OPTIMIZER_PARTS``): the finiteness check, the gradients copied into the update
groups' buffers (or read one by one), the update, the moment and weight stores, and
torch's fused step of plain float32 parameters.

``--preset gpt-1b`` (batch 8 x 1024, 20 blocks) does not fit a CPU step. Every count is
bilinear in the block count L and the batch B at fixed width and context, so the profile
runs the gpt-1b width and context at (L, B) in {1, 2} x {1, 2} and solves for
``a + b L + c B + d L B``: exact for the counts; no host time (the small preset gives it).
The H100 model (``H100Model``) keeps two clocks, host and GPU, over the step's stretches
and joins them at each sync and at the step's end. On the GPU the GEMMs and attention take
their FLOPs' time (their operands move meanwhile: ``gemm_operand_bytes``), every other byte
moves at a bandwidth, each kernel costs a little more, and the stochastic rounding's
integer operations a fixed time each. No constant is fitted to bench/results/gpt-cuda.json;
each is measured on an H100 microbenchmark (``measured_model``, ``measured_eager_bandwidth``,
``measured_int_op_s``; the JSON's ``h100_model.calibrated`` says which from which):
- GEMMs: ``nn.Linear`` and ``Fp8Linear`` compiled, forward + backward, at the largest shapes
  of linear-cuda.json (644 and 890 TFLOP/s, their casts included; gpt-1b's GEMMs, 4-16x
  fewer FLOPs each, are not recorded);
- bandwidth: torch's fused AdamW's kernels at 300M parameters (optimizer_kernels-cuda.json,
  2.71 TB/s), 28 bytes a parameter, of which the counter sees the 16 read
  (``add_modeled_bytes`` adds the 12 written); the aten kernels of amp8's optimizer step
  (FP8 gradients copied, their bytes' maxima) move 1.09 TB/s there;
- integer operations: amp8's update kernels beyond their bytes, per level (0.40-0.64 ps);
- kernels: 1.5 us, the median small kernel of those steps; graph calls 0.45 ms of host.
Against gpt-cuda.json (``predictions``) the BF16 step and its phases come within 5 %; amp8's
forward + backward is modeled 16-18 % short, because the counter reads the bytes of a
generated C++ kernel's arguments once per call where the GPU runs its loop nests as
kernels of their own: the FP8 casts re-read an operand for each maximum and cast, about
38 GB (O1, O2) and 28 GB (O3) more a gpt-1b step than counted (8 GB at O0), 10-14 ms at
the bandwidth. O3's optimizer is modeled 15 % short of its recorded 40 ms, which no
optimizer-only record explains. The predictions go to step_profile-<device>.json; other
presets write step_profile-<preset>-<device>.json with the same constants (their defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from rich.table import Table
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import amp8
from amp8.monitor.console import default_console
from amp8.nn.selection import DEFAULT_RULES
from amp8.optim import LowBitAdam
from amp8.tools.experiments.gpt import GPT, PRESETS, GPTConfig
from common import RESULTS, write_result
from compiled_graphs import GraphCall, GraphCalls
from optimizer import square_layers

aten = torch.ops.aten
LEVELS = ("O0", "O1", "O2", "O3")
PHASES = ("forward", "backward", "optimizer")
# amp8 functions (qualified names) whose operations make up a part of the optimizer step;
# the innermost one on the stack names the part, anything else is "update".
OPTIMIZER_PARTS = {
    "all_finite": "finite check",
    "UpdateGroup.gather": "gradient copy",
    "LowBitAdam.gradient": "gradient read",
    "StoredState.weight": "weight read",
    "adam_group_step": "update",
    "step_scalars": "step coefficients",
    "keep_amaxes": "amaxes kept",
    "StoredState.store_moment": "moment store",
    "UpdateGroup.run": "weight store",  # the plain weights copied back, the layers' casts dropped
    "StoredState.write_weight": "weight store",
    "plain_adam_step": "plain step",
}
# Operations that launch no kernel: allocations and metadata (views are found by schema).
NO_KERNEL = {aten.detach.default, aten.empty.memory_format, aten.empty_strided.default, aten.lift_fresh.default,
             aten._unsafe_view.default}  # a view its schema does not mark as one
# Operations that overwrite their first argument without reading it: it counts as written only.
OVERWRITE = {aten.copy_.default, aten.fill_.Scalar, aten.zero_.default}
SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default}
COUNTS = ("ops", "host_ops", "syncs", "bytes", "fp8_flops", "other_flops", "graph_calls", "graph_kernels", "graph_bytes",
          "int_ops")
INTEGER = (torch.int32, torch.int64)  # dtypes whose element operations count as int_ops
OPTIMIZERS = {"compiled": True, "reference": False}  # --optimizer: LowBitAdam's fused= for O1-O3
# The H100 records (bench/results/) the model is checked against and measured on:
RECORDED = RESULTS / "gpt-cuda.json"  # the gpt-1b steps the predictions are checked against
OPTIMIZER_RECORDED = RESULTS / "optimizer-cuda.json"  # amp8's optimizer-only steps: the optimizer check
KERNELS_RECORDED = RESULTS / "optimizer_kernels-cuda.json"  # the same steps' kernels, and torch's fused AdamW's
LINEAR_RECORDED = RESULTS / "linear-cuda.json"  # one layer's forward + backward, nn.Linear and Fp8Linear
# The gpt-1b counts of the code the H100 records ran (``--measure``), and the constants
# measured with them: later code is modeled with these constants, unchanged, so that a
# change of the code, not of the model, moves its modeled time.
RECORDED_CODE = RESULTS / "step_profile-recorded-code-cpu.json"
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
SMALL_KERNEL_S = 5e-6  # a recorded kernel call shorter than this moves next to nothing (``measured_kernel_s``)
GPT_1B_POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (blocks, batch) the gpt-1b counts are solved from


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
    (``StepCounter.stretches``); ``phase_seconds`` reads each phase's time off the GPU's
    clock, as CUDA events recorded between the phases do.

    The defaults are the H100 measurements ``measured_model`` and ``measured_int_op_s``
    read from bench/results/ (rounded; ``int_op_s`` the mean of the levels'), except
    ``launch_s`` and ``host_op_s``, which no record measures."""

    # GPU: bytes of the memory-bound kernels; torch's fused AdamW's kernels at 300M
    # parameters (``measured_bandwidth``, optimizer_kernels-cuda.json).
    bandwidth: float = 2.71e12
    # GPU: bytes of the aten kernels amp8's optimizer step launches (multi-tensor copies of
    # FP8 gradients, maxima of their bytes): the amp8 steps' kernels other than the update's
    # at 300M parameters (``measured_eager_bandwidth``, optimizer_kernels-cuda.json).
    eager_bandwidth: float = 1.09e12
    # GPU: GEMM FLOP/s, BF16 and FP8: nn.Linear and Fp8Linear forward + backward, compiled,
    # at linear-cuda.json's largest shapes (``measured_gemm_rates``); GPT attention runs at the BF16 rate.
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
    # to nothing in optimizer_kernels-cuda.json (``measured_kernel_s``).
    kernel_s: float = 1.5e-6
    # GPU: one integer element operation (the stochastic rounding's 32-bit hash, in int64
    # words in the compiled update: an H100 has no native int64 multiply); the update graph's
    # kernels in optimizer_kernels-cuda.json beyond their bytes, per level (``measured_int_op_s``).
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



def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(FP8 FLOPs, other GEMM FLOPs) of one operation."""
    packet = func._overloadpacket
    if packet is torch.ops.amp8.emulated_scaled_mm:  # rowwise FP8 GEMMs on a torch without them on the CPU
        return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1], 0
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return 0, flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return 0, flop_counter.sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
    if packet not in flop_counter.flop_registry:
        return 0, 0
    flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
    return (flops, 0) if packet is aten._scaled_mm else (0, flops)


def _optimizer_part() -> str:
    """The part of amp8's optimizer step the running operation belongs to."""
    frame = sys._getframe(2)
    while frame is not None:
        part = OPTIMIZER_PARTS.get(frame.f_code.co_qualname)
        if part is not None:
            return part
        frame = frame.f_back
    return "update"


class StepCounter(TorchDispatchMode):
    """Counts ops, syncs, bytes and GEMM FLOPs per phase (``with counter.phase(name)``),
    and the compiled-graph calls, their kernels and bytes (``compiled_graphs.GraphCalls``)."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.current = ""
        self.counts: dict[str, dict[str, float]] = {}
        self._graphs = GraphCalls(self._count_graph_call)
        # Tensors that stay on the CPU in a CUDA run (``host_scalars``) and what is computed
        # from them alone: reading one is no sync, and operating on one launches no kernel.
        self._host = WeakTensorKeyDictionary()
        for tensor in host_tensors:
            self._host[tensor] = True
        # The row whose operation produced each tensor: a sync waits for that row's work.
        self._producer = WeakTensorKeyDictionary()
        # Per phase, its counts between syncs: a sync ends a stretch (the clocks join there).
        self.stretches: dict[str, list[dict[str, float]]] = {}

    @classmethod
    def is_infra_mode(cls) -> bool:
        """True: torch.compile runs compiled code under an infra mode (it falls back to eager
        under any other), so the optimizer's compiled graphs run compiled, as in training;
        this mode then sees only the eager operations around them."""
        return True

    def __enter__(self) -> "StepCounter":
        self._graphs.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._graphs.__exit__(*exc)

    def _row_name(self) -> str:
        name = self.current
        return f"optimizer: {_optimizer_part()}" if name == "optimizer" else name

    def _row(self, name: str | None = None) -> dict[str, float]:
        return self.counts.setdefault(name or self._row_name(), dict.fromkeys(COUNTS, 0))

    def _count(self, name: str | None, **values: float) -> None:
        """Add ``values`` to row ``name`` (default: the running part) and to the phase's stretch."""
        row = self._row(name)
        stretch = self.stretches.setdefault(self.current, [dict.fromkeys(COUNTS, 0)])[-1]
        for key, value in values.items():
            row[key] += value
            stretch[key] += value

    def totals(self) -> dict[str, dict[str, float]]:
        """The counts per phase and part, each phase's row the sum of its parts' and its own;
        the parts of a phase in the order they first ran."""
        rows = {name: dict(row) for name, row in self.counts.items()}
        for name in PHASES:
            row = rows.setdefault(name, dict.fromkeys(COUNTS, 0))
            for part, counts in self.counts.items():
                if part.startswith(f"{name}: "):
                    for key in COUNTS:
                        row[key] += counts[key]
        return {name: rows[name] for name in sorted(rows, key=_order)}

    def _graph_row(self) -> str | None:
        # A compiled graph in the optimizer is its update, whichever amp8 function calls it.
        return "optimizer: update" if self.current == "optimizer" else None

    def _count_graph_call(self, call: GraphCall) -> None:
        if not self.current:
            return
        self._count(self._graph_row(), graph_calls=1, graph_kernels=call.kernels, graph_bytes=call.kernel_bytes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside the block under ``name``."""
        self.current = name
        try:
            yield
        finally:
            self.current = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.current:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self._graphs.inside:  # an extern kernel (GEMM) or fallback of a compiled graph: its bytes and FLOPs
            unique = {id(t): t for t in inputs + outputs if type(t) in (torch.Tensor, torch.nn.Parameter)}
            fp8, other = _flops(func, args, kwargs, out)
            self._count(self._graph_row(), graph_bytes=sum(t.nbytes for t in unique.values()), fp8_flops=fp8,
                        other_flops=other)
            return out
        on_host = bool(inputs) and all(t in self._host for t in inputs)
        if func in SYNC:
            if not on_host:  # a read of a GPU value: the host waits for the work that made it
                self._count(self._producer.get(inputs[0]), syncs=1)
                self.stretches[self.current].append(dict.fromkeys(COUNTS, 0))
            return out
        name = self._row_name()
        for tensor in outputs:
            if on_host:
                self._host[tensor] = True
            else:
                self._producer[tensor] = name
        if func.is_view or func in NO_KERNEL:
            return out
        if on_host:  # arithmetic on CPU scalars: host time, no kernel
            self._count(name, host_ops=1)
            return out
        read = inputs[1:] if func in OVERWRITE else inputs
        tensors = [t for t in read + outputs if type(t) in (torch.Tensor, torch.nn.Parameter)]
        fp8, other = _flops(func, args, kwargs, out)
        integer = sum(t.numel() for t in outputs if t.dtype in INTEGER)
        self._count(name, ops=1, bytes=sum(t.nbytes for t in tensors), fp8_flops=fp8, other_flops=other,
                    int_ops=integer)
        return out


def build(level: str, config: GPTConfig, layer_selection: str,
          optimizer_step: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT and optimizer of ``level`` ("O0": torch AdamW) from seeded weights, on the CPU;
    ``optimizer_step`` (a key of ``OPTIMIZERS``) picks amp8's compiled or reference step."""
    model: torch.nn.Module = GPT(config, torch.Generator().manual_seed(0))

    def adamw(params: Any) -> torch.optim.Optimizer:
        try:  # the fused CPU kernel where this torch has it
            return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
        except RuntimeError:
            return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), foreach=True)

    optimizer = adamw(model.parameters())
    if level == "O0":
        return model, optimizer
    selection = DEFAULT_RULES["cuda"] if layer_selection == "cuda" else "all"
    model, optimizer = amp8.initialize(model, optimizer, level, layer_selection=selection)
    low_bit = LowBitAdam.from_optimizer(adamw(model.parameters()), optimizer.level, fused=OPTIMIZERS[optimizer_step])
    return model, low_bit


def host_scalars(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of ``optimizer`` that a CUDA run keeps on the CPU: ``LowBitAdam``'s step
    counts (float32 scalars it creates without a device, as torch's unfused Adam does);
    torch's fused AdamW keeps its counts on the GPU and never reads them on the host."""
    if not isinstance(optimizer, LowBitAdam):
        return []
    return [state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)]


def run_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
             counter: StepCounter | None) -> dict[str, float]:
    """One training step under BF16 autocast; host seconds per phase (counted by ``counter``)."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    seconds = {}
    mode = counter if counter is not None else contextlib.nullcontext()
    with mode:
        for name in PHASES:
            inside = counter.phase(name) if counter is not None else contextlib.nullcontext()
            start = time.perf_counter()
            with inside:
                if name == "forward":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        _, loss = model(x, y)
                elif name == "backward":
                    loss.backward()
                else:
                    optimizer.step()
            seconds[name] = time.perf_counter() - start
    return seconds


def add_update_int_ops(optimizer: LowBitAdam, rows: dict[str, dict[str, float]],
                       stretches: dict[str, list[dict[str, float]]]) -> None:
    """Add to ``rows`` and the optimizer's last stretch (where its update runs, after the
    finite check's sync) the integer element operations of ``optimizer``'s compiled update,
    which no dispatch mode sees: counted on one more step of the same update run eagerly
    (``fused=False``: the same function, uncompiled), less those the compiled step ran eagerly.
    The eager step hashes in int32 where the compiled graph works in int64 words: the same
    operations per element."""
    compiled = rows["optimizer"]["int_ops"]
    optimizer.fused = False
    try:
        counter = StepCounter(host_scalars(optimizer))
        with counter, counter.phase("optimizer"):
            optimizer.step()
    finally:
        optimizer.fused = True
    extra = counter.totals()["optimizer"]["int_ops"] - compiled
    for row in (rows["optimizer"], rows.setdefault("optimizer: update", dict.fromkeys(COUNTS, 0)),
                stretches["optimizer"][-1]):
        row["int_ops"] += extra


def profile(level: str, config: GPTConfig, batch_size: int, steps: int, layer_selection: str,
            optimizer_step: str, blocks: str = "eager") -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, float]]]]:
    """Counts and host ms per phase (and per part of the optimizer) of one step at ``level``,
    and each phase's counts between syncs (``StepCounter.stretches``). ``blocks``
    "compiled" compiles each transformer block as bench/gpt.py does (``block.compile()``):
    their forward and backward are then counted as graph calls."""
    torch._dynamo.reset()  # compile afresh for this model: static shapes, no recompile limit reached
    model, optimizer = build(level, config, layer_selection, optimizer_step)
    if blocks == "compiled":
        for block in model.blocks:
            block.compile()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
    batch = (tokens[:, :-1], tokens[:, 1:])
    run_step(model, optimizer, batch, None)  # warm-up: lazy optimizer state, first-call costs
    times = [run_step(model, optimizer, batch, None) for _ in range(steps)]
    counter = StepCounter(host_scalars(optimizer))
    run_step(model, optimizer, batch, counter)
    rows = counter.totals()
    stretches = {name: counter.stretches.get(name, [dict.fromkeys(COUNTS, 0)]) for name in PHASES}
    if isinstance(optimizer, LowBitAdam) and optimizer.fused:
        add_update_int_ops(optimizer, rows, stretches)
    for name in PHASES:
        if times:
            rows[name]["cpu_ms"] = 1e3 * statistics.median(t[name] for t in times)
    return rows, stretches


def _order(name: str) -> tuple[int, bool]:
    """A phase's row, then its parts (``sorted`` keeps their order of first run)."""
    phase = name.split(":")[0]
    return PHASES.index(phase), name != phase


def solve_bilinear(points: dict[tuple[int, int], float], blocks: int, batch: int) -> float:
    """``f(blocks, batch)`` of the ``f = a + b L + c B + d L B`` through four (L, B) points at {1, 2}^2."""
    f11, f21, f12, f22 = (points[p] for p in GPT_1B_POINTS)
    d = f22 - f21 - f12 + f11
    b, c = f21 - f11 - d, f12 - f11 - d
    a = f11 - b - c - d
    return a + b * blocks + c * batch + d * blocks * batch


def profile_extrapolated(level: str, config: GPTConfig, batch_size: int, layer_selection: str,
                         optimizer_step: str, blocks: str) -> dict[str, Any]:
    """gpt-1b-sized counts from four small (blocks, batch) runs: ``phases`` and
    ``stretches`` as ``profile`` gives them."""
    runs, stretch_runs = {}, {}
    for n_layer, batch in GPT_1B_POINTS:  # host time is not bilinear enough to extrapolate: counts only
        runs[n_layer, batch], stretch_runs[n_layer, batch] = profile(
            level, dataclasses.replace(config, n_layer=n_layer), batch, 0, layer_selection, optimizer_step, blocks)
    stretches = {
        name: [{key: round(solve_bilinear({p: stretch_runs[p][name][i][key] for p in GPT_1B_POINTS},
                                          config.n_layer, batch_size)) for key in COUNTS}
               for i in range(len(stretch_runs[1, 1][name]))]
        for name in PHASES
    }
    result = {name: {key: round(solve_bilinear({p: runs[p].get(name, {}).get(key, 0.0) for p in GPT_1B_POINTS},
                                               config.n_layer, batch_size)) for key in runs[1, 1][name]}
              for name in runs[1, 1]}
    return {"phases": result, "stretches": stretches}


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


OPTIMIZER_WIDTH = 1024  # the layer width of bench/optimizer.py's recorded H100 runs


def optimizer_counts(level: str, layers: int) -> list[dict[str, float]]:
    """Counts of one compiled ``LowBitAdam`` step at ``level`` over ``layers`` square FP8
    layers with gradients in place, set up as bench/optimizer.py times it: one per stretch
    between syncs (``StepCounter.stretches``), the update's integer operations included
    (``add_update_int_ops``)."""
    torch.manual_seed(0)
    model = square_layers(layers * OPTIMIZER_WIDTH**2 / 1e6, OPTIMIZER_WIDTH, torch.device("cpu"))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level,
                                       layer_selection="all")
    fused = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=True)
    model(torch.randn(16, OPTIMIZER_WIDTH)).sum().backward()
    fused.step()  # compiles
    counter = StepCounter(host_scalars(fused))
    with counter, counter.phase("optimizer"):
        fused.step()
    stretches = {"optimizer": counter.stretches["optimizer"]}
    add_update_int_ops(fused, counter.totals(), stretches)
    return stretches["optimizer"]


def optimizer_check_counts(recorded: dict[str, Any]) -> list[dict[str, Any]]:
    """The counts of the compiled optimizer step at each size of bench/optimizer.py's H100
    runs (``recorded``), from counts at two and three layers, linear in the layers (at one
    layer the dynamic-shape graph specializes on sizes of 1 and differs)."""
    counts: dict[tuple[str, int], list[dict[str, float]]] = {}
    rows = []
    for run in recorded["step_time"]:
        level = run["level"]
        for layers in (2, 3):
            if (level, layers) not in counts:
                counts[level, layers] = optimizer_counts(level, layers)
        layers = max(1, round(run["millions"] * 1_000_000 / OPTIMIZER_WIDTH**2))  # as square_layers
        stretches = [{key: two[key] + (layers - 2) * (three[key] - two[key]) for key in COUNTS}
                     for two, three in zip(counts[level, 2], counts[level, 3], strict=True)]
        rows.append({"millions": run["millions"], "level": level, "layers": layers,
                     "recorded_ms": run["amp8_fused_ms"], "stretches": stretches})
    return rows


def optimizer_check(models: dict[str, H100Model], counted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The modeled compiled optimizer step (wall clock, sync to sync) against
    bench/optimizer.py's H100 timings (``amp8_fused_ms``) for the counts of
    ``optimizer_check_counts``, each level by its model in ``models``; every eager byte of
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


def update_kernel_seconds(row: dict[str, Any]) -> float:
    """GPU seconds of amp8's compiled update in one amp8 row of a bench/optimizer_kernels.py
    CUDA record: its generated kernels (``triton_``) and the scatter-reduce it falls back
    to (the per-tensor maxima, ``_scatter_gather``); the rest are the step's eager kernels."""
    return 1e-6 * sum(kernel["us"] for name, kernel in row["kernels"].items()
                      if name.startswith("triton_") or "_scatter_gather" in name)


def _counted_steps(record: dict[str, Any],
                   counted: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The amp8 rows of a bench/optimizer_kernels.py CUDA record, each with the counts of the
    same optimizer-only step among ``counted`` (``optimizer_check_counts`` rows)."""
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
    0.64 ps at O1, O2 and O3 on the H100, with O2 and O3 counted alike."""
    costs = {}
    for row, run in _counted_steps(record, counted):
        update = run["stretches"][-1]  # the update runs after the finite check's sync
        costs[run["level"]] = (update_kernel_seconds(row) - update["graph_bytes"] / model.bandwidth) / update["int_ops"]
    return costs


def print_table(level: str, phases: dict[str, dict[str, float]], modeled: dict[str, dict[str, float]],
                title: str) -> None:
    """One level's phases as a rich table, with each row's modeled host and GPU ms."""
    table = Table(title=f"{title}: {level}")
    for column in ("phase", "ops", "graph kernels", "syncs", "MB moved", "GFLOP fp8", "GFLOP other", "G int ops",
                   "CPU ms", "H100 host ms", "H100 GPU ms"):
        table.add_column(column, justify="right")
    for name, row in phases.items():
        cpu = f"{row['cpu_ms']:.1f}" if "cpu_ms" in row else ""
        table.add_row(name, f"{row['ops']:,.0f}", f"{row['graph_kernels']:,.0f}", f"{row['syncs']:,.0f}",
                      f"{(row['bytes'] + row['graph_bytes']) / 1e6:,.1f}", f"{row['fp8_flops'] / 1e9:,.1f}",
                      f"{row['other_flops'] / 1e9:,.1f}", f"{row['int_ops'] / 1e9:,.2f}", cpu,
                      f"{modeled[name]['host_ms']:.2f}", f"{modeled[name]['gpu_ms']:.2f}")
    default_console().print(table)


def print_predictions(predicted: dict[str, Any]) -> None:
    """Modeled against recorded ms per level: step, forward+backward, optimizer."""
    table = Table(title="gpt-1b on the H100: modeled / recorded ms (error)")
    table.add_column("level")
    for name, _ in TIMED:
        table.add_column(name.removesuffix("_ms").replace("_", "+"), justify="right")
    for level, row in predicted.items():
        cells = [f"{row[name]['modeled']:.1f} / {row[name]['recorded']:.1f} ({row[name]['error_pct']:+.0f} %)"
                 if "recorded" in row[name] else f"{row[name]['modeled']:.1f}" for name, _ in TIMED]
        table.add_row(level, *cells)
    default_console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 8 (as the recorded run)")
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--steps", type=int, default=3, help="timed plain steps (gpt-1b: none, counts only)")
    parser.add_argument("--layer-selection", choices=("cuda", "all"), default=None,
                        help="amp8's CUDA speed rule (default for gpt-1b, as recorded) or every layer")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="compiled",
                        help="amp8's optimizer step: compiled (fused=True, as on CUDA) or the eager reference")
    parser.add_argument("--blocks", choices=("compiled", "eager"), default=None,
                        help="transformer blocks compiled as bench/gpt.py does (default for gpt-1b, as recorded) "
                             "or eager")
    parser.add_argument("--counts", type=Path, default=None,
                        help="model the counts of this earlier JSON of the same preset instead of profiling")
    parser.add_argument("--measure", action="store_true",
                        help="measure the model's constants on the H100 records with this run's counts (for the "
                             f"code those records ran: {RECORDED_CODE.name}); default: take them from that file")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    big = args.preset == "gpt-1b"
    args.batch_size = args.batch_size or 8
    args.layer_selection = args.layer_selection or ("cuda" if big else "all")
    args.blocks = args.blocks or ("compiled" if big else "eager")
    if args.batch_size < 1 or args.steps < 0:
        parser.error(f"--batch-size={args.batch_size} and --steps={args.steps}: use >= 1 and >= 0")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Profile each level; returns the path of the JSON written."""
    args = parse_args(argv)
    config = PRESETS[args.preset]
    big = args.preset == "gpt-1b"
    results: dict[str, Any] = {}
    earlier = json.loads(args.counts.read_text()) if args.counts else {}
    for level in args.levels:
        if level in earlier.get("levels", {}):  # the counts of an earlier run, modeled anew
            results[level] = {key: earlier["levels"][level][key] for key in ("phases", "stretches")}
        elif big:
            results[level] = profile_extrapolated(level, config, args.batch_size, args.layer_selection,
                                                  args.optimizer, args.blocks)
        else:
            phases, stretches = profile(level, config, args.batch_size, args.steps, args.layer_selection,
                                        args.optimizer, args.blocks)
            results[level] = {"phases": phases, "stretches": stretches}
        print(f"{level} done", flush=True)
    for level, result in results.items():
        add_modeled_bytes(level, result, gemm_operand_bytes(config, args.batch_size, level, args.layer_selection))
    kernels = json.loads(KERNELS_RECORDED.read_text())
    model, calibrated = measured_model(json.loads(LINEAR_RECORDED.read_text()), kernels)
    models = dict.fromkeys(LEVELS, model)
    payload: dict[str, Any] = {
        "command": "python bench/step_profile.py" + (f" --preset {args.preset}" if args.preset != "small" else ""),
        "preset": args.preset, "config": dataclasses.asdict(config), "batch_size": args.batch_size,
        "steps": 0 if big else args.steps, "layer_selection": args.layer_selection, "autocast": "bfloat16",
        "blocks": {"compiled": "each transformer block compiled (block.compile()), counted as graph calls",
                   "eager": "eager, every operation counted"}[args.blocks],
        "amp8_optimizer": {"compiled": "LowBitAdam(fused=True): compiled graphs counted per call, as on CUDA",
                           "reference": "reference step (fused=False), every operation eager"}[args.optimizer],
        "counted_as": "ops: aten operations that run a kernel; bytes: nbytes in + out of each, plain tensors; "
                      "graph_bytes: the tensor arguments of each generated kernel and extern call",
    }
    fixed = None if args.measure or not RECORDED_CODE.exists() else json.loads(RECORDED_CODE.read_text())
    if fixed is not None:  # the constants measured once, with the counts of the code the H100 records ran
        constants = {key: value for key, value in fixed["h100_model"].items() if key not in ("calibrated", "int_op_s")}
        costs = fixed["h100_model"]["int_op_s"]
        model = dataclasses.replace(H100Model(**constants), int_op_s=statistics.fmean(costs.values()))
        models = {level: dataclasses.replace(model, int_op_s=costs[level]) for level in LEVELS}
        calibrated = [f"every constant as measured in {RECORDED_CODE.name} (--measure measures them anew): "
                      + "; ".join(fixed["h100_model"]["calibrated"])]
    elif big and args.optimizer == "compiled":  # constants measured on the optimizer-only steps, with their counts
        saved = earlier.get("optimizer_check", [])
        if not saved or not all("int_ops" in row["stretches"][-1] for row in saved):
            saved = optimizer_check_counts(json.loads(OPTIMIZER_RECORDED.read_text()))
        model = dataclasses.replace(model, eager_bandwidth=measured_eager_bandwidth(kernels, saved))
        costs = measured_int_op_s(model, kernels, saved)
        # O0's few integer operations (the embedding's indices) take the levels' mean
        model = dataclasses.replace(model, int_op_s=statistics.fmean(costs.values()))
        models = {level: dataclasses.replace(model, int_op_s=costs.get(level, model.int_op_s)) for level in LEVELS}
        calibrated += [
            f"eager_bandwidth: amp8's optimizer steps at {kernels['millions']}M parameters, their kernels other than "
            f"the update's, {KERNELS_RECORDED.name} with the counts of optimizer_check",
            f"int_op_s: amp8's update kernels at {kernels['millions']}M parameters beyond their bytes, per level "
            f"(O0: the mean), {KERNELS_RECORDED.name} with the counts of optimizer_check",
        ]
        payload["optimizer_check"] = optimizer_check(models, saved)
    if big:
        recorded = json.loads(RECORDED.read_text())
        same_run = recorded["config"] == dataclasses.asdict(config) and recorded["batch_size"] == args.batch_size
        if same_run and fixed is None:  # against the H100 records: for the code they ran only (RECORDED_CODE)
            payload["predictions"] = predictions(results, models, recorded)
        payload["solved_from"] = [{"n_layer": l, "batch_size": b} for l, b in GPT_1B_POINTS]
    payload["h100_model"] = {**dataclasses.asdict(model), "calibrated": calibrated,
                             "int_op_s": {level: models[level].int_op_s for level in LEVELS}}
    for level, result in results.items():
        model = models[level]
        modeled = {name: {"host_ms": 1e3 * model.host_seconds(row), "gpu_ms": 1e3 * model.device_seconds(row)}
                   for name, row in result["phases"].items()}
        result["modeled_h100_ms"] = {**modeled, "step": 1e3 * model.step_seconds(step_stretches(result))}
        print_table(level, result["phases"], modeled, f"GPT {args.preset} training step, batch {args.batch_size}")
    if "predictions" in payload:
        print_predictions(payload["predictions"])
    for row in payload.get("optimizer_check", []):
        print(f"optimizer {row['level']} {row['millions']}M: {row['graph_calls']:.0f} graph calls, "
              f"{row['int_ops'] / 1e9:.1f} G integer ops, modeled {row['modeled_ms']:.1f} ms, "
              f"recorded {row['recorded_ms']:.1f} ms ({row['error_pct']:+.0f} %)")
    payload["levels"] = results
    name = "step_profile" if big else f"step_profile-{args.preset}"  # the gpt-1b record is the one kept
    path = write_result(name, torch.device("cpu"), payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
