"""What ``amp8.Controller`` keeps for one FP8 layer, and the decisions that need nothing
but that and the layer's health: how its checks count, when it steps up or down, and
whether the last move made things worse and is undone.

``LayerWatch`` is saved in the optimizer's ``state_dict`` as plain Python values
(``to_state``, ``from_state``), so a resumed run decides the same, bit for bit. Moves
that weigh one layer against the others (the cap on the FLOPs in high precision) and
what a move does to the layer are the controller's business (``amp8.monitor.controller``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch

from amp8.config.controller import ControllerConfig
from amp8.config.gemms import Gemm, GemmOperand, Signal
from amp8.monitor.ladder import GemmState, Step, excess, made_worse


class Failing(NamedTuple):
    """An operand of a layer that crossed a threshold: what it crossed (in words) and its
    ``excess`` then."""

    operand: GemmOperand
    why: str
    excess: float


@dataclass(frozen=True)
class Trial:
    """A move to be measured at the next check: its label, the layer's state before it,
    the operands that made the layer move (those the move answers) and their ``excess``
    then, and every operand that failed."""

    label: str
    before: GemmState
    operands: tuple[GemmOperand, ...]
    excess: tuple[float, ...]
    failing: tuple[Failing, ...]

    @classmethod
    def of(cls, step: Step, before: GemmState, failing: list[Failing]) -> "Trial":
        """The trial of ``step``, taken from ``before`` for the ``failing`` operands."""
        by_operand = {entry.operand: entry.excess for entry in failing}
        return cls(step.label, before, step.operands, tuple(by_operand[operand] for operand in step.operands),
                   tuple(failing))

    def to_state(self) -> dict[str, Any]:
        """The trial as plain Python values (see ``from_state``)."""
        return {
            "label": self.label,
            "before": dataclasses.asdict(self.before),
            "operands": [int(operand) for operand in self.operands],
            "excess": list(self.excess),
            "failing": [[int(entry.operand), entry.why, entry.excess] for entry in self.failing],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Trial":
        """The trial ``to_state`` gave."""
        before = state["before"]
        return cls(
            state["label"],
            GemmState(before["rung"], tuple(before["high"]), before["split"]),  # type: ignore[arg-type]
            tuple(GemmOperand(operand) for operand in state["operands"]),
            tuple(state["excess"]),
            tuple(Failing(GemmOperand(operand), why, value) for operand, why, value in state["failing"]),
        )


@dataclass(frozen=True)
class Undone:
    """A move undone at a check: why (for the log), and the operands that failed, each
    judged by the worse of its signals before the move and those just measured (the
    next rung answers them)."""

    reason: str
    failing: list[Failing]


class Verdict(Enum):
    """What a check's count asks of a layer."""

    STAY = "stay"
    STEP_UP = "step up"
    STEP_DOWN = "step down"


@dataclass
class LayerWatch:
    """The controller's bookkeeping for one layer. ``rung`` (an index in
    ``GRANULARITY_LADDER``), ``high`` (per GEMM) and ``split`` are the precision the
    controller gives it; ``closed`` names the moves not to try again (undone or
    refused); ``trial`` is the move measured at the next check."""

    rung: int
    high: list[bool]
    failed_checks: int = 0
    passed_checks: int = 0
    last_amax: list[float] = dataclasses.field(default_factory=lambda: [0.0] * len(GemmOperand))
    cap_warned: bool = False
    peak_underflow: float = 0.0
    peak_saturated: float = 0.0
    split: bool = False
    closed: list[str] = dataclasses.field(default_factory=list)
    trial: Trial | None = None

    @property
    def state(self) -> GemmState:
        """The GEMM precision the controller gives the layer."""
        return GemmState(self.rung, (self.high[0], self.high[1], self.high[2]), self.split)

    def set_state(self, state: GemmState) -> None:
        """Give the layer ``state``."""
        self.rung, self.high, self.split = state.rung, list(state.high), state.split

    def observe(self, health: torch.Tensor) -> torch.Tensor | None:
        """Take in one check's ``health`` (operands, signals): the peaks and each operand's
        amax. Returns each operand's amax growth since the last check (1 where either is
        zero), or None for a step that overflowed (no finite amax): it is not checked."""
        amax = health[:, Signal.AMAX]
        if not torch.isfinite(amax).all():
            return None
        last = torch.tensor(self.last_amax)
        growth = torch.where((last > 0) & (amax > 0), amax / last.clamp(min=1e-30), torch.ones_like(amax))
        self.last_amax = [float(value) if value > 0 else float(old) for value, old in zip(amax, last)]
        self.peak_underflow = max(self.peak_underflow, float(health[:, Signal.UNDERFLOW].max()))
        self.peak_saturated = max(self.peak_saturated, float(health[:, Signal.SATURATED].max()))
        return growth

    def measure(self, trial: Trial, health: torch.Tensor, config: ControllerConfig) -> Undone | None:
        """Measure the last move (``trial``) on the operands that made it: where they got
        worse, step back and close the move (``Undone`` says why and what to answer
        next); None where the move is kept."""
        after = [excess(health, (operand,), config.thresholds) for operand in trial.operands]
        if not made_worse(list(trial.excess), after):
            return None
        self.set_state(trial.before)
        self.closed.append(trial.label)
        self.failed_checks = 0
        labels = "+".join(operand.label for operand in trial.operands)
        reason = (f"undone: {trial.label} made {labels} worse ({sum(trial.excess):.1f} -> {sum(after):.1f} "
                  "times the thresholds)")
        # The stress may have grown since the move: the next rung is judged against the
        # worse of the signals before it and those just measured.
        return Undone(reason, [
            Failing(entry.operand, entry.why, max(entry.excess, excess(health, (entry.operand,), config.thresholds)))
            for entry in trial.failing
        ])

    def count(self, failed: bool, urgent: bool, config: ControllerConfig) -> Verdict:
        """Count a check that ``failed`` (at once as ``patience`` failed checks where
        ``urgent``) or passed, and say whether the layer steps up (``patience`` failed in
        a row) or down (``step_down_after`` passed in a row)."""
        if failed:
            self.failed_checks = max(self.failed_checks + 1, config.patience if urgent else 0)
            self.passed_checks = 0
        else:
            self.failed_checks, self.passed_checks = 0, self.passed_checks + 1
        if self.failed_checks >= config.patience:
            self.failed_checks = 0
            return Verdict.STEP_UP
        if config.step_down_after is not None and self.passed_checks >= config.step_down_after:
            self.passed_checks = 0
            return Verdict.STEP_DOWN
        return Verdict.STAY

    def step_down(self, base: int) -> bool:
        """Go one rung back down, no lower than the rung ``base`` (the recipe's): first
        out of high precision, then off the outlier split, then to a coarser
        granularity. False where the layer stands at ``base`` already."""
        self.trial = None
        if any(self.high):
            self.high = [False] * len(Gemm)
        elif self.split:
            self.split = False
        elif self.rung > base:
            self.rung -= 1
        else:
            return False
        return True

    def to_state(self) -> dict[str, Any]:
        """The watch as plain Python values (the controller's ``state_dict``)."""
        state = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        state = {key: list(value) if isinstance(value, list) else value for key, value in state.items()}
        state["trial"] = None if self.trial is None else self.trial.to_state()
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "LayerWatch":
        """The watch ``to_state`` gave."""
        trial = state.get("trial")
        return cls(**{**state, "trial": None if trial is None else Trial.from_state(trial)})
