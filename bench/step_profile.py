"""Where a GPT training step's time goes: forward, backward and optimizer step counted on
the CPU (aten operations dispatched, bytes they move, GEMM FLOPs, host time), and a
simple H100 model that turns the counts into milliseconds.

    python bench/step_profile.py                     # small preset, O0-O3, about a minute
    python bench/step_profile.py --preset tiny --levels O0 O1
    python bench/step_profile.py --preset gpt-1b     # counts for the recorded H100 run

Each level builds amp8's byte-level GPT (amp8/tools/experiments/gpt.py) from the same
seeded weights and runs eagerly under BF16 autocast, as bench/gpt.py runs on CUDA:
O0 is the baseline (torch AdamW, fused where the CPU has it, else foreach), O1-O3 are
``amp8.initialize`` with amp8's optimizer step compiled as on CUDA (``--optimizer
compiled``, ``LowBitAdam(fused=True)``) or its eager reference (``--optimizer reference``,
every operation of the update visible). One warm-up step, then ``--steps`` plain steps give the host
time per phase (median), then one step under a ``TorchDispatchMode`` gives the counts:
- ops: aten operations that run a kernel (views, ``detach`` and allocations are left out),
  a proxy for GPU kernel launches in eager mode; syncs: ``.item()``-style reads;
- bytes: the nbytes of every plain tensor an operation takes plus those it returns, an
  upper bound of its memory traffic (a kernel may read a broadcast operand once, and an
  in-place result is counted as read and written);
- GEMM FLOPs from ``torch.utils.flop_counter``'s formulas: ``_scaled_mm`` as FP8, the
  rest (mm, addmm, bmm, attention) as high precision.
- graph calls: calls of compiled graphs, each with the bytes of its tensor inputs,
  outputs and in-place writes and the GPU kernels its generated code stands for
  (``compiled_graphs.GraphCalls``), however the optimizer groups its parameters into them.
Inside amp8's optimizer step the operations are split by the amp8 function they run
in (``OPTIMIZER_PARTS``): the finiteness check, the gradients copied into the update
groups' buffers (or read one by one), the update, the moment and weight stores, and
torch's fused step of plain float32 parameters.

``--preset gpt-1b`` (batch 8 x 1024, 20 blocks) does not fit a CPU step. Every count is
bilinear in the block count L and the batch B at fixed width and context, so the profile
runs the gpt-1b width and context at (L, B) in {1, 2} x {1, 2} and solves for
``a + b L + c B + d L B``: exact for the counts; no host time (the small preset gives it).
The H100 model (``H100Model``), calibrated once on the recorded BF16 baseline, and its
predictions against bench/results/gpt-cuda.json go to step_profile-<device>.json; other
presets write step_profile-<preset>-<device>.json with the uncalibrated (eager) model.
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
from typing import Any, Iterator

import torch
from rich.table import Table
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import amp8
from amp8.monitor.console import default_console
from amp8.nn.selection import DEFAULT_RULES
from amp8.optim import LowBitAdam
from amp8.tools.experiments.gpt import GPT, PRESETS, GPTConfig
from common import RESULTS, write_result
from compiled_graphs import GraphCall, GraphCalls
from optimizer import WIDTH, square_layers

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
    "_store": "moment store",  # amp8.optim.group_step and amp8.optim.fused
    "StoredState.store_moment": "moment store",
    "_encode_fp16": "weight store",
    "_encode_fp8": "weight store",
    "UpdateGroup.run": "weight store",  # the scales copied back to the layers
    "StoredState.write_weight": "weight store",
    "plain_adam_step": "plain step",
}
# Operations that launch no kernel: allocations and metadata (views are found by schema).
NO_KERNEL = {aten.detach.default, aten.empty.memory_format, aten.empty_strided.default, aten.lift_fresh.default}
SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default}
COUNTS = ("ops", "syncs", "bytes", "fp8_flops", "other_flops", "graph_calls", "graph_kernels", "graph_bytes")
OPTIMIZERS = {"compiled": True, "reference": False}  # --optimizer: LowBitAdam's fused= for O1-O3
RECORDED = RESULTS / "gpt-cuda.json"
OPTIMIZER_RECORDED = RESULTS / "optimizer-cuda.json"
# Host seconds per compiled-graph call on the recorded H100 machine, beyond its kernel
# launches: bench/results/optimizer-cuda.json's six compiled optimizer-only runs (O1-O3,
# 30M and 300M parameters) spend 0.28-0.64 ms per graph call more than their counted
# launches and bytes, 0.45 ms on average; one number for every level and size.
GRAPH_CALL_S = 0.45e-3
GPT_1B_POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (blocks, batch) the gpt-1b counts are solved from


@dataclasses.dataclass(frozen=True)
class H100Model:
    """time = ops * launch_s + bytes / bandwidth + fp8_flops / fp8_rate + other_flops / bf16_rate,
    the launch and bytes terms scaled where the recorded run compiled the code
    (``compiled_factor``), plus for the compiled graphs the profile ran as such
    graph_calls * graph_call_s + graph_kernels * launch_s + graph_bytes / bandwidth."""

    bandwidth: float = 2.8e12  # B/s: 3.35 TB/s HBM3 peak, ~85 % achievable
    bf16_rate: float = 0.65 * 989e12  # FLOP/s: dense BF16 peak, ~65 % reached by large GEMMs
    fp8_rate: float = 0.65 * 1979e12  # FLOP/s: dense FP8 peak, same share
    launch_s: float = 6e-6  # per eager kernel launch (host and launch gap)
    # Host time of one compiled-graph call beyond its kernel launches: dynamo's guards on
    # its inputs, the AOT wrapper, and the caller's Python that prepares it.
    graph_call_s: float = GRAPH_CALL_S
    # The recorded run compiled every block: fusion cuts the launches and bytes of the
    # non-GEMM work there. One factor, fitted once so the model gives the recorded BF16 baseline.
    compiled_factor: float = 1.0

    def seconds(self, counts: dict[str, float], compiled_share: float) -> float:
        """Modeled time of ``counts``; ``compiled_share`` (0-1) of its ops and bytes ran compiled."""
        scale = 1 - compiled_share + compiled_share * self.compiled_factor
        graphs = (counts.get("graph_calls", 0) * self.graph_call_s + counts.get("graph_kernels", 0) * self.launch_s
                  + counts.get("graph_bytes", 0) / self.bandwidth)
        return (scale * (counts["ops"] * self.launch_s + counts["bytes"] / self.bandwidth) + graphs
                + counts["fp8_flops"] / self.fp8_rate + counts["other_flops"] / self.bf16_rate)


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

    def __init__(self) -> None:
        super().__init__()
        self.current = ""
        self.counts: dict[str, dict[str, float]] = {}
        self._graphs = GraphCalls(self._count_graph_call)

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

    def _row(self, eager_op: bool) -> dict[str, float]:
        name = self.current
        if name == "optimizer" and eager_op:
            name = f"optimizer: {_optimizer_part()}"
        return self.counts.setdefault(name, dict.fromkeys(COUNTS, 0))

    def totals(self) -> dict[str, dict[str, float]]:
        """The counts per phase and part, each phase's row the sum of its parts' and its own."""
        rows = {name: dict(row) for name, row in self.counts.items()}
        for name in PHASES:
            row = rows.setdefault(name, dict.fromkeys(COUNTS, 0))
            for part, counts in self.counts.items():
                if part.startswith(f"{name}: "):
                    for key in COUNTS:
                        row[key] += counts[key]
        return {name: rows[name] for name in sorted(rows, key=_order)}

    def _count_graph_call(self, call: GraphCall) -> None:
        if not self.current:
            return
        row = self._row(eager_op=True)
        row["graph_calls"] += 1
        row["graph_kernels"] += call.kernels
        row["graph_bytes"] += call.read_bytes + call.written_bytes

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
        if not self.current or self._graphs.inside or func.is_view or func in NO_KERNEL:
            return out
        row = self._row(eager_op=func not in SYNC)
        if func in SYNC:
            row["syncs"] += 1
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if type(t) in (torch.Tensor, torch.nn.Parameter)]
        fp8, other = _flops(func, args, kwargs, out)
        row["ops"] += 1
        row["bytes"] += sum(t.nbytes for t in tensors)
        row["fp8_flops"] += fp8
        row["other_flops"] += other
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


def profile(level: str, config: GPTConfig, batch_size: int, steps: int, layer_selection: str,
            optimizer_step: str) -> dict[str, dict[str, float]]:
    """Counts and host ms per phase (and per part of the optimizer) of one step at ``level``."""
    model, optimizer = build(level, config, layer_selection, optimizer_step)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=generator)
    batch = (tokens[:, :-1], tokens[:, 1:])
    run_step(model, optimizer, batch, None)  # warm-up: lazy optimizer state, first-call costs
    times = [run_step(model, optimizer, batch, None) for _ in range(steps)]
    counter = StepCounter()
    run_step(model, optimizer, batch, counter)
    rows = counter.totals()
    for name in PHASES:
        if times:
            rows[name]["cpu_ms"] = 1e3 * statistics.median(t[name] for t in times)
    return rows


def _order(name: str) -> tuple[int, str]:
    return PHASES.index(name.split(":")[0]), name


def solve_bilinear(points: dict[tuple[int, int], float], blocks: int, batch: int) -> float:
    """``f(blocks, batch)`` of the ``f = a + b L + c B + d L B`` through four (L, B) points at {1, 2}^2."""
    f11, f21, f12, f22 = (points[p] for p in GPT_1B_POINTS)
    d = f22 - f21 - f12 + f11
    b, c = f21 - f11 - d, f12 - f11 - d
    a = f11 - b - c - d
    return a + b * blocks + c * batch + d * blocks * batch


def profile_extrapolated(level: str, config: GPTConfig, batch_size: int,
                         layer_selection: str, optimizer_step: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """gpt-1b-sized counts from four small (blocks, batch) runs; also each phase's
    share of ops and bytes that lies in the blocks (compiled in the recorded run)."""
    runs = {}
    for blocks, batch in GPT_1B_POINTS:  # host time is not bilinear enough to extrapolate: counts only
        runs[blocks, batch] = profile(level, dataclasses.replace(config, n_layer=blocks), batch, 0, layer_selection, optimizer_step)
    result: dict[str, dict[str, float]] = {}
    block_share: dict[str, float] = {}
    for name in runs[1, 1]:
        row = {key: solve_bilinear({p: runs[p].get(name, {}).get(key, 0.0) for p in GPT_1B_POINTS},
                                   config.n_layer, batch_size) for key in runs[1, 1][name]}
        result[name] = {key: round(value) for key, value in row.items()}
        if name in PHASES:
            one_block = {key: solve_bilinear({p: runs[p][name][key] for p in GPT_1B_POINTS}, 1, batch_size)
                         - solve_bilinear({p: runs[p][name][key] for p in GPT_1B_POINTS}, 0, batch_size)
                         for key in ("ops", "bytes")}
            cost = row["ops"] * H100Model.launch_s + row["bytes"] / H100Model.bandwidth
            block_cost = config.n_layer * (one_block["ops"] * H100Model.launch_s + one_block["bytes"] / H100Model.bandwidth)
            block_share[name] = block_cost / cost if cost else 0.0
    return result, block_share


def compiled_shares(block_share: dict[str, float]) -> dict[str, float]:
    """Share of each phase's eager ops and bytes that ran compiled in the recorded run: the
    blocks in forward and backward; none of the optimizer's (torch's fused AdamW is one
    kernel already, and amp8's compiled graphs are counted as graph calls)."""
    return {"forward": block_share["forward"], "backward": block_share["backward"], "optimizer": 0.0}


def calibrate(baseline: dict[str, dict[str, float]], shares: dict[str, float], measured_ms: float) -> H100Model:
    """The model whose ``compiled_factor`` makes the baseline's modeled step ``measured_ms``
    (the modeled time is linear in the factor)."""
    at = {f: sum(H100Model(compiled_factor=f).seconds(baseline[p], shares[p]) for p in PHASES) for f in (0.0, 1.0)}
    factor = (measured_ms / 1e3 - at[0.0]) / (at[1.0] - at[0.0])
    return H100Model(compiled_factor=factor)


def compiled_row(recorded: dict[str, Any], run: str) -> dict[str, Any]:
    """The compiled row of ``run`` in a bench/gpt.py record (``{}`` where it has none);
    records written before the eager rows hold the compiled row under the run alone."""
    row = recorded["runs"].get(run, {})
    return row.get("compiled", row)


def predictions(results: dict[str, Any], model: H100Model, recorded: dict[str, Any]) -> dict[str, Any]:
    """Modeled gpt-1b ms per level and phase against the recorded step times."""
    names = {"O0": "baseline", "O1": "amp8 O1", "O2": "amp8 O2"}
    out = {}
    for level, result in results.items():
        shares = result["compiled_share"]
        phases = {p: 1e3 * model.seconds(result["phases"][p], shares[p]) for p in PHASES}
        row: dict[str, Any] = {"modeled_ms": sum(phases.values()), "phases_ms": phases}
        run = compiled_row(recorded, names.get(level, ""))
        if "step_ms" in run:
            row["recorded_ms"] = run["step_ms"]
            row["error_pct"] = 100 * (row["modeled_ms"] / run["step_ms"] - 1)
        out[level] = row
    return out


def optimizer_counts(level: str, layers: int) -> dict[str, float]:
    """Counts of one compiled ``LowBitAdam`` step at ``level`` over ``layers`` square FP8
    layers with gradients in place, set up as bench/optimizer.py times it."""
    torch.manual_seed(0)
    model = square_layers(layers * WIDTH * WIDTH, torch.device("cpu"))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level,
                                       layer_selection="all")
    fused = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level, fused=True)
    model(torch.randn(16, WIDTH)).sum().backward()
    fused.step()  # compiles
    counter = StepCounter()
    with counter, counter.phase("optimizer"):
        fused.step()
    return counter.totals()["optimizer"]


def optimizer_check(model: H100Model, recorded: dict[str, Any]) -> list[dict[str, Any]]:
    """The modeled compiled optimizer step against bench/optimizer.py's H100 timings
    (``amp8_fused_ms``), same sizes; counts at one and two layers, linear in the layers."""
    counts: dict[tuple[str, int], dict[str, float]] = {}
    rows = []
    for run in recorded["step_time"]:
        level = run["level"]
        for layers in (1, 2):
            if (level, layers) not in counts:
                counts[level, layers] = optimizer_counts(level, layers)
        layers = max(1, round(run["millions"] * 1_000_000 / (WIDTH * WIDTH)))  # as square_layers
        one, two = counts[level, 1], counts[level, 2]
        row = {key: one[key] + (layers - 1) * (two[key] - one[key]) for key in COUNTS}
        modeled = 1e3 * model.seconds(row, 0.0)
        rows.append({"millions": run["millions"], "level": level, "layers": layers,
                     "graph_calls": row["graph_calls"], "graph_kernels": row["graph_kernels"],
                     "graph_gb": row["graph_bytes"] / 1e9, "eager_ops": row["ops"],
                     "modeled_ms": modeled, "recorded_ms": run["amp8_fused_ms"],
                     "error_pct": 100 * (modeled / run["amp8_fused_ms"] - 1)})
    return rows


def print_table(level: str, phases: dict[str, dict[str, float]], modeled: dict[str, float], title: str) -> None:
    """One level's phases as a rich table."""
    table = Table(title=f"{title}: {level}")
    for column in ("phase", "ops", "syncs", "MB moved", "GFLOP fp8", "GFLOP other", "CPU ms", "H100 ms"):
        table.add_column(column, justify="right")
    for name, row in phases.items():
        cpu = f"{row['cpu_ms']:.1f}" if "cpu_ms" in row else ""
        h100 = f"{modeled[name]:.2f}" if name in modeled else ""
        table.add_row(name, f"{row['ops']:,.0f}", f"{row['syncs']:,.0f}", f"{row['bytes'] / 1e6:,.1f}",
                      f"{row['fp8_flops'] / 1e9:,.1f}", f"{row['other_flops'] / 1e9:,.1f}", cpu, h100)
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
    parser.add_argument("--counts", type=Path, default=None,
                        help="model the counts of this earlier JSON of the same preset instead of profiling")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    big = args.preset == "gpt-1b"
    args.batch_size = args.batch_size or 8
    args.layer_selection = args.layer_selection or ("cuda" if big else "all")
    if args.batch_size < 1 or args.steps < 0:
        parser.error(f"--batch-size={args.batch_size} and --steps={args.steps}: use >= 1 and >= 0")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Profile each level; returns the path of the JSON written."""
    args = parse_args(argv)
    config = PRESETS[args.preset]
    big = args.preset == "gpt-1b"
    results: dict[str, Any] = {}
    counted = json.loads(args.counts.read_text())["levels"] if args.counts else {}
    for level in args.levels:
        if level in counted:  # the counts of an earlier run, modeled anew
            block_share = counted[level].get("block_share", counted[level]["compiled_share"])
            shares = compiled_shares(block_share) if big else dict.fromkeys(PHASES, 0.0)
            results[level] = {"phases": counted[level]["phases"], "compiled_share": shares, "block_share": block_share}
        elif big:
            phases, block_share = profile_extrapolated(level, config, args.batch_size, args.layer_selection, args.optimizer)
            results[level] = {"phases": phases, "compiled_share": compiled_shares(block_share), "block_share": block_share}
        else:
            phases = profile(level, config, args.batch_size, args.steps, args.layer_selection, args.optimizer)
            results[level] = {"phases": phases, "compiled_share": dict.fromkeys(PHASES, 0.0)}
        print(f"{level} done", flush=True)
    model = H100Model()
    payload: dict[str, Any] = {
        "command": "python bench/step_profile.py" + (f" --preset {args.preset}" if args.preset != "small" else ""),
        "preset": args.preset, "config": dataclasses.asdict(config), "batch_size": args.batch_size,
        "steps": 0 if big else args.steps, "layer_selection": args.layer_selection, "autocast": "bfloat16",
        "amp8_optimizer": {"compiled": "LowBitAdam(fused=True): compiled graphs counted per call, as on CUDA",
                           "reference": "reference step (fused=False), every operation eager"}[args.optimizer],
        "counted_as": "ops: aten operations that run a kernel; bytes: nbytes in + out of each, plain tensors",
    }
    if big:
        recorded = json.loads(RECORDED.read_text())
        if "O0" in results and recorded["config"] == dataclasses.asdict(config) and recorded["batch_size"] == args.batch_size:
            model = calibrate(results["O0"]["phases"], results["O0"]["compiled_share"], compiled_row(recorded, "baseline")["step_ms"])
            payload["predictions"] = predictions(results, model, recorded)
        if args.optimizer == "compiled":
            payload["optimizer_check"] = optimizer_check(model, json.loads(OPTIMIZER_RECORDED.read_text()))
        payload["solved_from"] = [{"n_layer": l, "batch_size": b} for l, b in GPT_1B_POINTS]
    payload["h100_model"] = {**dataclasses.asdict(model), "calibrated": "compiled_factor, on the O0 baseline" if big else "not calibrated (eager)"}
    for level, result in results.items():
        modeled = {name: 1e3 * model.seconds(row, result["compiled_share"][name.split(":")[0]])
                   for name, row in result["phases"].items()}
        result["modeled_h100_ms"] = modeled
        print_table(level, result["phases"], modeled, f"GPT {args.preset} training step, batch {args.batch_size}")
    if "predictions" in payload:
        for level, row in payload["predictions"].items():
            recorded_text = f", recorded {row['recorded_ms']:.1f} ms ({row['error_pct']:+.0f} %)" if "recorded_ms" in row else ""
            print(f"{level}: modeled {row['modeled_ms']:.1f} ms{recorded_text}")
    for row in payload.get("optimizer_check", []):
        print(f"optimizer {row['level']} {row['millions']}M: {row['graph_calls']:.0f} graph calls, modeled "
              f"{row['modeled_ms']:.1f} ms, recorded {row['recorded_ms']:.1f} ms ({row['error_pct']:+.0f} %)")
    payload["levels"] = results
    name = "step_profile" if big else f"step_profile-{args.preset}"  # the gpt-1b record is the one kept
    path = write_result(name, torch.device("cpu"), payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
