"""The rungs ``amp8.Controller`` may take for a layer, in the order it tries them, and how
it judges a move: pure functions of a layer's GEMM precision and its failing operands.

The order depends on which operand fails:

- Under one scale per tensor, any failing cast first gets scales along its GEMM's
  contraction ("rowwise": per token row for activations, which the outlier split needs too).
- wgrad's operands (its input and output gradient, cast along tokens) fail on token
  outliers. A block along tokens still holds the outlier rows, so they never take the
  block rung: first the outlier split (``Recipe.wgrad_outlier_split``), then wgrad in
  high precision.
- fprop's input and dgrad's output gradient take ``1 x block_size`` tiles along K under
  "block", finer than one scale per row: they may take the block rung, then high
  precision for their GEMMs. A failing weight goes to high precision directly (a
  ``block_size`` square is coarser than a row along the weight's other dimension).

The granularity never goes below where the layer stands, so a rowwise start never
"steps up" to a scale coarser along the dimension that fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from amp8.config.controller import GEMM_NAMES, HealthThresholds
from amp8.config.gemms import Gemm, GemmOperand, Signal
from amp8.config.recipe import GRANULARITY_LADDER, Granularity

ROWWISE = GRANULARITY_LADDER.index(Granularity.ROWWISE)
BLOCK = GRANULARITY_LADDER.index(Granularity.BLOCK)
WGRAD_OPERANDS = frozenset({GemmOperand.WGRAD_GRAD_OUTPUT, GemmOperand.WGRAD_INPUT})
"""The casts along tokens: token outliers fail them."""
BLOCK_OPERANDS = frozenset({GemmOperand.FPROP_INPUT, GemmOperand.DGRAD_GRAD_OUTPUT})
"""The operands whose block tiles (``1 x block_size`` along K) are finer than rowwise's."""
WORSE_MARGIN = 0.1
"""An operand got worse (better) at the check after a move where its ``excess`` rose
(fell) by more than this share: one batch's noise neither undoes a move nor credits one."""


@dataclass(frozen=True)
class GemmState:
    """How the controller runs one layer's GEMMs: the granularity's index in
    ``GRANULARITY_LADDER``, the GEMMs (fprop, dgrad, wgrad) it moved to high precision,
    and whether wgrad's outlier tokens are split off."""

    rung: int
    high: tuple[bool, bool, bool]
    split: bool


@dataclass(frozen=True)
class Step:
    """One move up: its name (what ``ControllerConfig`` and the log call it), the state it
    leads to, and the failing operands it answers."""

    label: str
    state: GemmState
    operands: tuple[GemmOperand, ...]


def candidate_steps(state: GemmState, failing: set[GemmOperand], *, split: bool = True) -> list[Step]:
    """The moves up for a layer at ``state`` whose ``failing`` operands cross a threshold
    (those of GEMMs already in high precision left out), in the order to try them (see
    the module docstring); ``split`` allows the outlier split. None where none fails."""
    steps: list[Step] = []
    if not failing:
        return steps
    if state.rung < ROWWISE:
        steps.append(Step("rowwise", replace(state, rung=ROWWISE), tuple(sorted(failing))))
    wgrad = tuple(sorted(failing & WGRAD_OPERANDS))
    if wgrad and not state.high[Gemm.WGRAD]:
        if split and not state.split:
            steps.append(Step("wgrad outlier split", replace(state, rung=max(state.rung, ROWWISE), split=True), wgrad))
        steps.append(Step("wgrad high", _with_high(state, [Gemm.WGRAD]), wgrad))
    other = tuple(sorted(failing - WGRAD_OPERANDS))
    if set(other) & BLOCK_OPERANDS and state.rung < BLOCK:
        steps.append(Step("block", replace(state, rung=BLOCK), other))
    gemms = sorted({operand.gemm for operand in other if not state.high[operand.gemm]})
    if gemms:
        steps.append(Step("+".join(GEMM_NAMES[gemm] for gemm in gemms) + " high", _with_high(state, gemms), other))
    return steps


def _with_high(state: GemmState, gemms: list[Gemm]) -> GemmState:
    high = list(state.high)
    for gemm in gemms:
        high[gemm] = True
    return replace(state, high=(high[0], high[1], high[2]))


def excess(health: torch.Tensor, operands: tuple[GemmOperand, ...] | list[int], thresholds: HealthThresholds) -> float:
    """How far ``operands`` of one layer's ``health`` (operands, signals) lie beyond the
    thresholds: the sum over them of the larger of (share flushed / its threshold) and
    (share clipped / its threshold). A move that lowers it helped."""
    rows = health[[int(operand) for operand in operands]].float()
    ratios = torch.stack([rows[:, Signal.UNDERFLOW] / thresholds.underflow,
                          rows[:, Signal.SATURATED] / thresholds.saturation])
    return float(ratios.amax(0).sum())


def made_worse(before: list[float], after: list[float]) -> bool:
    """Whether a move made things worse: the ``excess`` of some operand that made the
    layer move rose at the next check, and that of none fell (by more than
    ``WORSE_MARGIN``). A move that heals one operand while another grows (a stress that
    grows meanwhile) is kept."""
    rose = any(a > b * (1 + WORSE_MARGIN) for b, a in zip(before, after))
    fell = any(a * (1 + WORSE_MARGIN) < b for b, a in zip(before, after))
    return rose and not fell
