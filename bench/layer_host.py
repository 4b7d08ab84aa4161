"""Host time of one FP8 layer's forward, this checkout against another revision.

    OMP_NUM_THREADS=1 python bench/layer_host.py --against HEAD~1
    OMP_NUM_THREADS=1 python bench/layer_host.py --against HEAD~1 --layers 32 --rounds 3 --repeats 30
    OMP_NUM_THREADS=1 python bench/layer_host.py --against HEAD~1 --layers 8 --eager --rounds 3 --repeats 30

A 64 x 64 ``Fp8Linear`` on a batch of 16 rows, in training mode with autograd on, so
that the time is the layer's Python and dispatch work rather than its arithmetic. With
``--layers N``: ``zero_grad``, forward and backward of ``model.compile()`` of N such
layers trained by ``LowBitAdam`` (after three steps, so its gradient slots exist), the
host work of a compiled training step besides the optimizer's; with ``--eager`` too, the
model is not compiled and runs its casts as amp8's compiled kernels (``compiled_casts=
True``, CUDA's default), the host work of an eager training step. Each
revision runs in its own process (``git worktree`` of ``--against`` in a temporary
folder), the two alternating ``--rounds`` times so that drift of the machine falls on
both; per level, the median over rounds of each round's median forward time, and the
ratio this checkout / the other. Results go to ``--out``/layer_host-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from records import RESULTS, write_result
from timing import time_call

LEVELS = ("O1", "O2", "O3")
ROOT = Path(__file__).resolve().parent.parent


def measure(repeats: int) -> dict[str, float]:
    """Median seconds of one forward per level, in this process's amp8."""
    import amp8

    x = torch.randn(16, 64, requires_grad=True)
    times = {}
    for level in LEVELS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=amp8.Recipe())
        times[level] = time_call(lambda: model(x), torch.device("cpu"), 50, repeats)
    return times


def measure_training(layers: int, repeats: int, compiled: bool = True) -> dict[str, float]:
    """Median seconds of one ``zero_grad``, forward and backward per level of a model of
    ``layers`` 64 x 64 FP8 layers that ``LowBitAdam`` trains, in this process's amp8:
    compiled, or eager with compiled casts. Each is timed after a step (its forward casts
    the weights again)."""
    import amp8
    from amp8.optim import LowBitAdam

    x = torch.randn(16, 64)
    times = {}
    for level in LEVELS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
        model, _ = amp8.initialize(model, None, level, layer_selection="all", compiled_casts=None if compiled else True)
        optimizer = LowBitAdam(model.parameters(), lr=1e-3, level=level)
        if compiled:
            model.compile()

        def forward_backward() -> None:
            optimizer.zero_grad()
            model(x).square().mean().backward()

        for _ in range(3):
            forward_backward()
            optimizer.step()
        samples = []
        for _ in range(repeats):
            samples.append(time_call(forward_backward, torch.device("cpu"), 0, 1))
            optimizer.step()
        times[level] = statistics.median(samples)
    return times


def _run(tree: Path, repeats: int, layers: int, eager: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = Path(__file__).resolve()
    out = subprocess.run(
        [sys.executable, str(script), "--measure", "--repeats", str(repeats), "--layers", str(layers),
         *(["--eager"] if eager else [])],
        env=env, cwd=script.parent, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    """Alternate the two revisions and write the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD~1", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=0,
                        help="time a compiled model of this many layers' forward and backward (0: one layer's forward)")
    parser.add_argument("--eager", action="store_true",
                        help="with --layers: the model eager, its casts amp8's compiled kernels")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.measure:
        times = measure_training(args.layers, args.repeats, not args.eager) if args.layers else measure(args.repeats)
        print(json.dumps(times))
        return
    with tempfile.TemporaryDirectory() as folder:
        other = Path(folder) / "other"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), args.against],
                       check=True, capture_output=True)
        try:
            rounds: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
            for _ in range(args.rounds):
                rounds["this"].append(_run(ROOT, args.repeats, args.layers, args.eager))
                rounds["other"].append(_run(other, args.repeats, args.layers, args.eager))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=True)
    result = {}
    for level in LEVELS:
        this = statistics.median(r[level] for r in rounds["this"])
        that = statistics.median(r[level] for r in rounds["other"])
        result[level] = {"this_us": this * 1e6, "other_us": that * 1e6, "ratio": this / that}
        print(f"{level}: {this * 1e6:.1f} us against {that * 1e6:.1f} us ({this / that:.3f}x)")
    kind = "eager" if args.eager else "compiled"
    name, timed = (f"layer_host-{kind}-training", f"{kind}_{args.layers}_layers") if args.layers \
        else ("layer_host", "forward")
    write_result(name, torch.device("cpu"), {
        "against": args.against, "rounds": args.rounds, "repeats": args.repeats,
        "threads": torch.get_num_threads(), timed: result,
    }, args.out)


if __name__ == "__main__":
    main()
