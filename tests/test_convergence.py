"""The convergence bar, on real data: the byte-level GPT on the standard library's sources.

One ``compare`` run trains the same model from the same seed at every level, the
no-scaling ablation, and O0 from three seeds to measure the seed-to-seed spread. Bars
(final validation loss, relative to O0 from the same seed):

- O1 and O2: within 0.25 % of O0, or within O0's seed spread if that is larger;
- O3: within 0.5 %, or within the spread if larger;
- O1 without scaling (FP8 casts with scale 1): at least 2 % worse than O1.

Sized for CI: a 2-layer, 128-wide GPT, context 64, 200 steps of 16 sequences.
"""

from __future__ import annotations

import pytest

from amp8.experiments.compare import ABLATION, CompareConfig, CompareResult, compare
from amp8.experiments.gpt import PRESETS

BARS_PERCENT = {"O1": 0.25, "O2": 0.25, "O3": 0.5}
ABLATION_MARGIN_PERCENT = 2.0
CONFIG = CompareConfig(
    model=PRESETS["small"], steps=200, batch_size=16, lr=1e-3, seeds=3, eval_interval=200,
    eval_batches=16, torchao=False,
)


@pytest.fixture(scope="module")
def result() -> CompareResult:
    return compare(CONFIG, out_dir=None, progress=False, plot=False)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_level_matches_o0(result: CompareResult, level: str) -> None:
    run = result.run(level)
    assert run.ok, f"{level} did not train: {run.reason}"
    spread = result.o0_seed_spread()
    assert spread is not None
    bar = max(BARS_PERCENT[level], spread["spread_percent"])
    gap = result.gap_percent(level)
    assert abs(gap) <= bar, (
        f"{level} val loss {run.final_val_loss:.4f} is {gap:+.3f}% from O0 "
        f"{result.baseline.final_val_loss:.4f}; bar {bar:.3f}% "
        f"(O0 seed spread {spread['spread_percent']:.3f}%)"
    )
    assert run.skipped_steps == 0, f"{level} skipped {run.skipped_steps} steps on overflow"


def test_o0_seed_spread_is_small(result: CompareResult) -> None:
    spread = result.o0_seed_spread()
    assert spread is not None and spread["seeds"] == 3
    # A loose bar is no bar: the spread must stay well under the ablation's margin.
    assert spread["spread_percent"] < 1.0, f"O0 seed spread {spread['spread_percent']:.2f}% is too wide"


def test_no_scaling_is_measurably_worse(result: CompareResult) -> None:
    o1, ablation = result.run("O1"), result.run(ABLATION)
    margin = 100 * (ablation.final_val_loss - o1.final_val_loss) / o1.final_val_loss
    assert margin >= ABLATION_MARGIN_PERCENT, (
        f"{ABLATION} val loss {ablation.final_val_loss:.4f} is only {margin:+.2f}% above O1's "
        f"{o1.final_val_loss:.4f}; expected >= {ABLATION_MARGIN_PERCENT}%"
    )
