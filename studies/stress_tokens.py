"""Token outliers at 1/64, 1/16 and 1/4 of the tokens: does the controller ever end worse
than no controller, and how close does it come to the unstressed run?

    OMP_NUM_THREADS=1 python studies/stress_tokens.py                 # 54 runs, about 10 min on one core
    OMP_NUM_THREADS=1 python studies/stress_tokens.py --seeds 0 --shares 0.0625 --placements most --starts rowwise
    OMP_NUM_THREADS=1 python studies/stress_tokens.py --name stress-tokens-probe --shares 0.0625 --placements most \
        --starts rowwise --steps 300 --widths 256 512 512 512 256 --batch-size 16    # the reported probe's size

The model (``amp8.tools.experiments.token_stress``) is a token-wise MLP of four Linears
(128-256 wide, a fourth of the reported probe's GEMM FLOPs so that the study runs well
under 30 minutes on one core), 8 sequences of 32 tokens a batch, 200 steps of AdamW,
regressed on a fixed teacher; the loss leaves out every fourth token. A stress
multiplies every ``1 / share``-th token's row of one Linear's input by a gain that
ramps to 2**20 over the first 20 % of the steps: in one layer (the last Linear's
input) or in most (the second Linear's input: it and the two after it). For every
stress, start (the default O1 recipe, rowwise, and the same recipe tensorwise) and seed:
stressed O1 with and without ``amp8.Controller()``, and the unstressed O1 and O0 runs
(O0 trains alike with and without the stress, in exact arithmetic). Writes
studies/results/stress-tokens-cpu.json: per run the final validation loss, and for the
controlled runs the moves and the share of GEMM FLOPs left in FP8; per case the gaps
to unstressed O1 (percent, mean over seeds) and whether the controller meets its target.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

import amp8
from amp8 import ControllerConfig
from amp8.frontend import default_recipe
from amp8.tools.experiments.token_stress import TokenRun, TokenSetup, TokenStress, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

NAME = "stress-tokens"
SETUP = TokenSetup(widths=(128, 256, 256, 256, 128), batch_size=8, steps=200)
SHARES = (1 / 64, 1 / 16, 1 / 4)
PLACEMENTS = {"one": 3, "most": 1}
"""Where the outliers enter: the index of the Linear whose input is scaled."""
DEFAULT = default_recipe(amp8.config.levels.O1)
STARTS = {"rowwise": DEFAULT, "tensorwise": DEFAULT.replace(granularity="tensorwise")}
TOLERANCE_PERCENT = 0.25
MIN_FP8_SHARE = 0.85


def _timed(run: TokenRun, seed: int, setup: TokenSetup) -> dict[str, Any]:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cap's warnings: the moves record them
        record = train(run, seed, setup)
    return {**record, "seed": seed, "wall_s": time.perf_counter() - start}


def _gap(loss: float, reference: float) -> float:
    return 100 * (loss - reference) / reference


def summarize(cases: list[dict[str, Any]], o0: dict[int, float], unstressed: dict[str, dict[int, float]]) -> dict[str, Any]:
    """O0's seed spread, unstressed O1's gap to O0, and per case the mean gaps to
    unstressed O1 with and without the controller, its FP8 share and the verdict."""
    losses = list(o0.values())
    spread = 100 * (max(losses) - min(losses)) / statistics.fmean(losses) if len(losses) > 1 else 0.0
    tolerance = max(TOLERANCE_PERCENT, spread)
    rows = []
    for case in cases:
        reference = unstressed[case["start"]]
        plain = [_gap(run["final_val_loss"], reference[run["seed"]]) for run in case["stressed"]]
        controlled = [_gap(run["final_val_loss"], reference[run["seed"]]) for run in case["controlled"]]
        share = statistics.fmean(run["gemm_fp8_share"] for run in case["controlled"])
        never_worse = all(c <= p for c, p in zip(controlled, plain))
        rows.append({
            "start": case["start"], "share": case["share"], "placement": case["placement"],
            "gap_stressed_percent": statistics.fmean(plain), "gap_controlled_percent": statistics.fmean(controlled),
            "gemm_fp8_share": share, "controller_never_worse": never_worse,
            "meets_target": never_worse and statistics.fmean(controlled) <= tolerance and share >= MIN_FP8_SHARE,
        })
    o1_gap = {start: statistics.fmean(_gap(loss, o0[seed]) for seed, loss in losses_.items())
              for start, losses_ in unstressed.items()}
    return {"o0_seed_spread_percent": spread, "tolerance_percent": tolerance,
            "unstressed_o1_gap_to_o0_percent": o1_gap, "cases": rows}


def markdown_table(summary: dict[str, Any]) -> str:
    """The cases as the markdown table of docs/controller.md."""
    lines = ["| start | outliers | layers | O1 stressed | O1 stressed + controller | FP8 share | target |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["cases"]:
        lines.append(
            f"| {row['start']} | 1/{round(1 / row['share'])} | {row['placement']} | "
            f"{row['gap_stressed_percent']:+.2f} % | {row['gap_controlled_percent']:+.2f} % | "
            f"{100 * row['gemm_fp8_share']:.1f} % | {'met' if row['meets_target'] else 'missed'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the study, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    parser.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    parser.add_argument("--starts", nargs="+", choices=list(STARTS), default=list(STARTS))
    parser.add_argument("--steps", type=int, default=SETUP.steps)
    parser.add_argument("--widths", type=int, nargs="+", default=list(SETUP.widths), help="the Linears' widths")
    parser.add_argument("--batch-size", type=int, default=SETUP.batch_size, help="sequences of 32 tokens a batch")
    parser.add_argument("--name", default=NAME, help="results file name: <name>-cpu.json")
    args = parser.parse_args(argv)
    setup = TokenSetup(**{**SETUP.__dict__, "steps": args.steps, "widths": tuple(args.widths),
                          "batch_size": args.batch_size})
    o0 = {seed: _timed(TokenRun("O0"), seed, setup)["final_val_loss"] for seed in args.seeds}
    print(f"O0: {o0}", flush=True)
    unstressed: dict[str, dict[int, float]] = {}
    cases = []
    for start in args.starts:
        recipe = STARTS[start]
        unstressed[start] = {seed: _timed(TokenRun("O1", recipe), seed, setup)["final_val_loss"] for seed in args.seeds}
        print(f"O1 {start} unstressed: {unstressed[start]}", flush=True)
        for share in args.shares:
            for placement in args.placements:
                stress = TokenStress(share=share, layer=PLACEMENTS[placement])
                case = {"start": start, "share": share, "placement": placement, "stressed": [], "controlled": []}
                for seed in args.seeds:
                    case["stressed"].append(_timed(TokenRun("O1", recipe, stress=stress), seed, setup))
                    case["controlled"].append(
                        _timed(TokenRun("O1", recipe, ControllerConfig(), stress), seed, setup))
                print(f"{start} 1/{round(1 / share)} {placement}: stressed "
                      f"{[round(r['final_val_loss'], 9) for r in case['stressed']]}, controlled "
                      f"{[round(r['final_val_loss'], 9) for r in case['controlled']]}, FP8 share "
                      f"{[round(r['gemm_fp8_share'], 3) for r in case['controlled']]}", flush=True)
                cases.append(case)
    summary = summarize(cases, o0, unstressed)
    print(markdown_table(summary))
    print(f"O0 seed spread {summary['o0_seed_spread_percent']:.2f} %; unstressed O1 to O0 "
          f"{summary['unstressed_o1_gap_to_o0_percent']}")
    path = write_result(args.name, torch.device("cpu"), {
        "command": " ".join(["OMP_NUM_THREADS=1 python studies/stress_tokens.py",
                             *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "threads": torch.get_num_threads(), "setup": setup.__dict__, "seeds": args.seeds,
        "max_log2_gain": TokenStress().log2_gain, "ramp_fraction": TokenStress().ramp_fraction,
        "summary": summary, "o0": o0, "unstressed_o1": unstressed,
        "cases": [{key: value for key, value in case.items()} for case in cases],
    }, RESULTS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
