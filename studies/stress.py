"""The FP8 outlier stress case: what one scale per tensor loses, and what repairs it.

    OMP_NUM_THREADS=1 python studies/stress.py                  # 4 variants x seeds 0 1 2, ~9 min on one core
    OMP_NUM_THREADS=1 python studies/stress.py --seeds 0 --variants O0 O1-tensorwise
    python studies/stress.py --table                          # the markdown again from the recorded JSON
    OMP_NUM_THREADS=1 python studies/stress.py --name stress-microscaled \
        --variants O0 O1-mxfp8 O1-mxfp8-controller O1-nvfp4 O1-nvfp4-controller   # ~20 min

Every variant trains the byte GPT of ``amp8 compare`` (``CompareConfig()``: "small"
preset, 300 steps of 16 x 64 bytes, lr 1e-3, stdlib corpus) under the default
``OutlierStress`` (``amp8.tools.experiments.stress``): the input of the last block's MLP
down-projection has its position-0 row multiplied by a gain that ramps from 1 to 2**24
over the first 30 % of the steps, and position 0 is left out of the loss. O0 is
unchanged by it in exact arithmetic. Each run records its final validation loss, its gap
to O0 from the same seed, and, every ``--probe-every`` steps, the share of the stressed
input's nonzero values that each FP8 input cast (``stress.CASTS``) flushes to zero,
measured on that run's own tensor. Writes studies/results/stress-<device>.json and a
markdown table beside it.

A variant is a name -> (opt level, recipe, controller settings or None) entry of
``VARIANTS``; a run with settings trains with a fresh ``amp8.Controller`` and records its
moves and the share of GEMM FLOPs left in FP8.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from amp8 import ControllerConfig, Recipe
from amp8.tools.experiments.compare import CompareConfig, RunSpec, _recipe_dict, train_run, validation_batches
from amp8.tools.experiments.corpus import load_corpus
from amp8.tools.experiments.gpt import PRESETS
from amp8.tools.experiments.stress import CASTS, OutlierStress, UnderflowProbe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

NAME = "stress"
BASELINE = "O0"
ONSET_SHARE = 0.1
"""The tensorwise underflow share that marks the onset of the stress."""

Variant = tuple[str, Recipe, "ControllerConfig | None"]
DEFAULT_VARIANTS: dict[str, Variant] = {
    BASELINE: ("O0", Recipe(), None),
    "O1-tensorwise": ("O1", Recipe(), None),
    "O1-rowwise": ("O1", Recipe(granularity="rowwise"), None),
    "O1-rowwise-wgrad-high": ("O1", Recipe(granularity="rowwise", override_linear_precision=(False, False, True)), None),
    "O1-controller": ("O1", Recipe(), ControllerConfig()),
}
"""The variants the study runs by default: name -> (opt level, recipe, the settings of an
``amp8.Controller`` or None)."""
MICROSCALED_VARIANTS: dict[str, Variant] = {
    "O1-mxfp8": ("O1", Recipe.preset("mxfp8"), None),
    "O1-mxfp8-controller": ("O1", Recipe.preset("mxfp8"), ControllerConfig()),
    "O1-nvfp4": ("O1", Recipe.preset("nvfp4"), None),
    # NVFP4's stressed layer loses fprop and wgrad: two of its three GEMMs, 11 % of the
    # small preset's GEMM FLOPs, above the default cap of 10 %.
    "O1-nvfp4-controller": ("O1", Recipe.preset("nvfp4"), ControllerConfig(max_high_precision_share=0.2)),
}
"""The Blackwell formats under the same stress (``--variants`` names them)."""
VARIANTS = {**DEFAULT_VARIANTS, **MICROSCALED_VARIANTS}


def stress_config(preset: str, steps: int, stress: OutlierStress) -> CompareConfig:
    """The default ``amp8 compare`` setup with ``stress``, on ``preset`` for ``steps``."""
    return CompareConfig(model=PRESETS[preset], steps=steps, stress=stress, ablation=False, torchao=False)


def run_variant(name: str, seed: int, config: CompareConfig, probe_every: int,
                corpus: Any, val_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Train variant ``name`` from ``seed`` and return its record: losses, validation
    curve and the underflow shares of the stressed input per probed step."""
    assert config.stress is not None
    level, recipe, controller = VARIANTS[name]
    probe = UnderflowProbe(config.stress, set(range(0, config.steps, probe_every)))
    spec = RunSpec(name, level, seed, recipe, controller=controller)
    result = train_run(spec, config, corpus, val_batches, on_step=probe.on_step, on_model=probe.attach)
    if not result.ok:
        raise RuntimeError(f"variant {name!r} did not train: {result.reason}")
    return {
        "variant": name, "seed": seed, "level": level, "recipe": _recipe_dict(recipe),
        "controller": controller is not None, "controller_moves": result.controller_moves,
        "gemm_fp8_share": result.gemm_fp8_share,
        "final_val_loss": result.final_val_loss, "final_train_loss": result.final_train_loss,
        "val_curve": result.val_curve, "wall_s": result.wall_s,
        "underflow": [{"step": step, "log2_gain": config.stress.log2_gain(step, config.steps), **shares}
                      for step, shares in sorted(probe.shares.items())],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-seed gaps to O0 (percent), their mean per variant, O0's seed spread, and the
    onset step (first probed step whose tensorwise share reaches ``ONSET_SHARE``)."""
    base = {run["seed"]: run["final_val_loss"] for run in runs if run["variant"] == BASELINE}
    for run in runs:
        run["gap_percent"] = 100 * (run["final_val_loss"] - base[run["seed"]]) / base[run["seed"]]
    gaps: dict[str, list[float]] = {}
    for run in runs:
        gaps.setdefault(run["variant"], []).append(run["gap_percent"])
    losses = list(base.values())
    onset = [next((p["step"] for p in run["underflow"] if p["tensorwise"] >= ONSET_SHARE), None)
             for run in runs if run["variant"] == BASELINE]
    return {
        "mean_gap_percent": {name: statistics.fmean(values) for name, values in gaps.items() if name != BASELINE},
        "o0_seed_spread_percent": 100 * (max(losses) - min(losses)) / statistics.fmean(losses) if len(losses) > 1 else None,
        "onset_step": onset,
    }


def markdown(record: dict[str, Any]) -> str:
    """The record as a markdown page: final losses and gaps per seed, then underflow shares."""
    runs, seeds = record["runs"], record["seeds"]
    names = list(dict.fromkeys(run["variant"] for run in runs))
    by_key = {(run["variant"], run["seed"]): run for run in runs}
    summary = record["summary"]
    lines = [
        f"# FP8 outlier stress ({record['device']})", "",
        f"`{record['command']}` (torch {record['torch']}, {record['threads']} thread(s), {record['date']}); "
        f"{record['config_line']}.", "",
        f"Stress: {record['stress_line']}. Final validation loss (nats/byte, position 0 excluded) and gap to O0 "
        "from the same seed; mean gap over seeds.", "",
        "| variant | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean gap |",
        "|---|" + "---|" * (len(seeds) + 1),
    ]
    for name in names:
        cells = []
        for seed in seeds:
            run = by_key.get((name, seed))
            cells.append("" if run is None else f"{run['final_val_loss']:.4f}"
                         + ("" if name == BASELINE else f" ({run['gap_percent']:+.2f}%)"))
        mean = summary["mean_gap_percent"].get(name)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if mean is None else f'{mean:+.2f}%'} |")
    spread = summary["o0_seed_spread_percent"]
    lines += ["", f"O0 seed spread (max - min over seeds, % of the mean): {'-' if spread is None else f'{spread:.2f}'}. "
              f"Onset (first probed step with tensorwise underflow >= {ONSET_SHARE:.0%}), per seed: "
              f"{summary['onset_step']} of {record['config']['steps']}.", ""]
    controlled = [run for run in runs if run.get("controller")]
    if controlled:
        lines += ["Controller runs: share of the FP8 layers' GEMM FLOPs still in FP8 at the end, per seed: "
                  + ", ".join(f"{run['variant']} seed {run['seed']} {100 * run['gemm_fp8_share']:.1f} %"
                              for run in controlled) + f". Moves, seed {controlled[0]['seed']}:", ""]
        lines += [f"- step {m['step']}: {m['layer']} {m['before']} -> {m['after']} ({m['reason']})"
                  for m in controlled[0]["controller_moves"]] + [""]
    block_size = PRESETS[record["config"]["preset"]].block_size
    lines += [f"Share of the stressed input's nonzero values flushed to zero by each cast "
              f"({', '.join(CASTS)}), seed {seeds[0]}; tensorwise serves fprop and wgrad, rowwise casts "
              f"per token row for fprop and per column of tokens for wgrad. {(block_size - 1) / block_size:.3f} "
              f"({block_size - 1} of {block_size} positions) is every value outside the outlier rows.", ""]
    probe_steps = [p["step"] for p in by_key[(names[0], seeds[0])]["underflow"]]
    steps, ramp_end = record["config"]["steps"], record["stress"]["ramp_fraction"] * record["config"]["steps"]
    shown = sorted({probe_steps[0], *(s for s in probe_steps if 0.1 * steps <= s <= ramp_end),
                    *[s for s in probe_steps if s >= steps // 2][:1], probe_steps[-1]})
    lines += ["| variant | cast | " + " | ".join(f"step {s}" for s in shown) + " |",
              "|---|---|" + "---|" * len(shown)]
    gains = {p["step"]: p["log2_gain"] for p in by_key[(names[0], seeds[0])]["underflow"]}
    lines.append("| log2 gain | | " + " | ".join(f"{gains[s]:.1f}" for s in shown) + " |")
    for name in names:
        points = {p["step"]: p for p in by_key[(name, seeds[0])]["underflow"]}
        for cast in CASTS:
            lines.append(f"| {name} | {cast} | " + " | ".join(f"{points[s][cast]:.3f}" for s in shown) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> Path:
    """Run the variants asked for over the seeds; write JSON and markdown; return the JSON path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    parser.add_argument("--name", default=NAME, help="results file name: <name>-<device>.json")
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=CompareConfig().steps)
    parser.add_argument("--probe-every", type=int, default=10, help="steps between underflow measurements")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="only rewrite the markdown from the JSON in --out")
    args = parser.parse_args(argv)
    if args.table:
        path = args.out / f"{args.name}-cpu.json"
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        print(f"wrote {path.with_suffix('.md')}")
        return path
    if BASELINE not in args.variants:
        parser.error(f"--variants must include {BASELINE!r}: every gap is measured against it")
    stress = OutlierStress()
    config = stress_config(args.preset, args.steps, stress)
    corpus = load_corpus(config.corpus)
    val_batches = validation_batches(config, corpus)
    runs = []
    for seed in args.seeds:
        for name in args.variants:
            run = run_variant(name, seed, config, args.probe_every, corpus, val_batches)
            print(f"{name} seed {seed}: final val loss {run['final_val_loss']:.4f} ({run['wall_s']:.0f} s)", flush=True)
            runs.append(run)
    model = config.model
    record = {
        "command": " ".join(["OMP_NUM_THREADS=" + str(torch.get_num_threads()), "python", "studies/stress.py",
                             *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "threads": torch.get_num_threads(),
        "config": {"preset": args.preset, "steps": config.steps, "batch_size": config.batch_size, "lr": config.lr,
                   "corpus": config.corpus.source, "probe_every": args.probe_every},
        "config_line": (f"GPT {model.n_layer}x{model.n_embd} (ctx {model.block_size}), {config.steps} steps x "
                        f"{config.batch_size} seqs, lr {config.lr:g}, {config.corpus.source} corpus"),
        "stress": stress.to_dict(), "stress_line": stress.describe(),
        "seeds": args.seeds, "variants": args.variants,
        "runs": runs, "summary": summarize(runs),
    }
    path = write_result(args.name, torch.device(config.device), record, args.out)
    written = json.loads(path.read_text())
    path.with_suffix(".md").write_text(markdown(written))
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return path


if __name__ == "__main__":
    main()
