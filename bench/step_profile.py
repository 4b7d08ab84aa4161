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
time per phase (median), then one step under ``counting.StepCounter`` gives the counts
(ops, host ops on the optimizer's step counts, which a CUDA run keeps on the CPU
(``host_scalars``), syncs, bytes, GEMM FLOPs, compiled-graph calls with their kernels and
bytes, integer operations; bench/counting.py says how each is counted). The compiled
update's integer operations are counted on one more step of the same update run eagerly
(``add_update_int_ops``).
Inside amp8's optimizer step the operations are split by the amp8 function they run
in (``counting.OPTIMIZER_PARTS``): the finiteness check, the gradients copied into the update
groups' buffers (or read one by one), the update, the moment and weight stores, and
torch's fused step of plain float32 parameters.

``--preset gpt-1b`` (batch 8 x 1024, 20 blocks) does not fit a CPU step. Every count is
bilinear in the block count L and the batch B at fixed width and context, so the profile
runs the gpt-1b width and context at (L, B) in {1, 2} x {1, 2} and solves for
``a + b L + c B + d L B``: exact for the counts; no host time (the small preset gives it).
The H100 model (bench/step_model.py) keeps two clocks, host and GPU, over the step's
stretches; its constants are measured on H100 microbenchmarks (bench/step_constants.py),
none fitted to bench/results/gpt-cuda.json.
Against gpt-cuda.json (``step_model.predictions``) the BF16 step and its phases come within 5 %; amp8's
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
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

import amp8
from amp8.monitor.console import default_console
from amp8.nn.selection import DEFAULT_RULES
from amp8.optim import LowBitAdam
from amp8.tools.experiments.gpt import GPT, PRESETS, GPTConfig
from counting import COUNTS, PHASES, StepCounter
from optimizer import square_layers
from records import RESULTS, command_line, write_result
from step_constants import (
    KERNELS_RECORDED, LINEAR_RECORDED, OPTIMIZER_RECORDED, RECORDED, RECORDED_CODE, fixed_models, measured_model,
    optimizer_models,
)
from step_model import (
    LEVELS, TIMED, add_modeled_bytes, gemm_operand_bytes, optimizer_check, predictions, step_stretches,
)
from timing import PhaseClock

OPTIMIZERS = {"compiled": True, "reference": False}  # --optimizer: LowBitAdam's fused= for O1-O3
GPT_1B_POINTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (blocks, batch) the gpt-1b counts are solved from


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
    clock = PhaseClock(torch.device("cpu"))
    mode = counter if counter is not None else contextlib.nullcontext()
    with mode:
        clock.mark()
        for name in PHASES:
            inside = counter.phase(name) if counter is not None else contextlib.nullcontext()
            with inside:
                if name == "forward":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        _, loss = model(x, y)
                elif name == "backward":
                    loss.backward()
                else:
                    optimizer.step()
            clock.mark()
    return {name: 1e-3 * ms for name, ms in zip(PHASES, clock.phases_ms(), strict=True)}


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
        "command": command_line("step_profile.py", argv),
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
        model, models, calibrated = fixed_models(fixed)
    elif big and args.optimizer == "compiled":  # constants measured on the optimizer-only steps, with their counts
        saved = earlier.get("optimizer_check", [])
        if not saved or not all("int_ops" in row["stretches"][-1] for row in saved):
            saved = optimizer_check_counts(json.loads(OPTIMIZER_RECORDED.read_text()))
        model, models, measured = optimizer_models(model, kernels, saved)
        calibrated += measured
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
