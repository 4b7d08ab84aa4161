"""The settings of ``amp8.Controller`` and the record of what it did: the health
thresholds that make a layer move, the precision schedule, the controller's
configuration, and one ``Move`` of a layer's GEMM precision. All are validated on
construction and say what to use instead."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch

from amp8.config.gemms import Gemm, GemmOperand, Signal

GEMM_NAMES = tuple(gemm.name.lower() for gemm in Gemm)
"""Each ``Gemm``'s name as settings and reasons spell it: "fprop", "dgrad", "wgrad"."""


def _check_fraction(field: str, value: Any, *, allow_zero: bool = True) -> None:
    low_ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and value <= 1):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{field}={value!r} is not valid; use a share in {bound}")


def _names(value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple of names: a string is one name, not its characters."""
    return (value,) if isinstance(value, str) else tuple(value)


def _check_count(field: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        none = " or None" if optional else ""
        raise ValueError(f"{field}={value!r} is not valid; use an int >= 1{none}")


@dataclass(frozen=True)
class HealthThresholds:
    """When a GEMM operand's cast counts as unhealthy.

    Attributes:
        underflow: the share of its nonzero values that the cast flushes to zero.
        saturation: the share of its values that the cast clips at the format's max.
        amax_growth: the ratio of its amax to the amax at the previous check, or None
            to ignore amax growth (under current scaling a growing amax costs nothing
            by itself; under delayed scaling it announces clipping).
    """

    underflow: float = 0.01
    saturation: float = 0.001
    amax_growth: float | None = None

    def __post_init__(self) -> None:
        _check_fraction("HealthThresholds.underflow", self.underflow, allow_zero=False)
        _check_fraction("HealthThresholds.saturation", self.saturation, allow_zero=False)
        growth = self.amax_growth
        if growth is not None and (isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth > 1):
            raise ValueError(f"HealthThresholds.amax_growth={growth!r} is not valid; use a ratio > 1 or None")

    def violations(self, health: torch.Tensor, growth: torch.Tensor | None) -> list[tuple[GemmOperand, str]]:
        """The operands of one layer's ``health`` (operands, signals) that cross a
        threshold, each with what it crossed, worst signal first per operand."""
        found = []
        for operand in GemmOperand:
            row = health[operand]
            reasons = []
            if row[Signal.UNDERFLOW] > self.underflow:
                reasons.append(f"{100 * float(row[Signal.UNDERFLOW]):.1f} % of nonzero values flushed to zero "
                               f"(threshold {100 * self.underflow:g} %)")
            if row[Signal.SATURATED] > self.saturation:
                reasons.append(f"{100 * float(row[Signal.SATURATED]):.2f} % of values clipped "
                               f"(threshold {100 * self.saturation:g} %)")
            if growth is not None and self.amax_growth is not None and growth[operand] > self.amax_growth:
                reasons.append(f"amax grew {float(growth[operand]):.1f}x since the last check "
                               f"(threshold {self.amax_growth:g}x)")
            if reasons:
                found.append((operand, reasons[0]))
        return found


@dataclass(frozen=True)
class PrecisionPhase:
    """From step ``start`` on, the GEMMs named in ``high`` of the FP8 layers whose names
    match one of ``layers`` (``fnmatch`` patterns, e.g. ``"blocks.11.*"``) run in high
    precision.

    Attributes:
        start: a step (an int >= 0), or a share of ``ControllerConfig.total_steps`` (a
            float in (0, 1], e.g. 0.9 for the last 10 % of training).
        high: GEMM names among "fprop", "dgrad", "wgrad" (one name alone may be a string).
        layers: patterns of module names (as ``model.named_modules()`` gives them); one
            pattern alone may be a string.
    """

    start: int | float
    high: tuple[str, ...] = ("fprop",)
    layers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "high", _names(self.high))
        object.__setattr__(self, "layers", _names(self.layers))
        start = self.start
        if isinstance(start, bool) or not isinstance(start, (int, float)):
            raise ValueError(f"PrecisionPhase.start={start!r} is not valid; use a step (int) or a share (float)")
        if isinstance(start, float):
            _check_fraction("PrecisionPhase.start", start, allow_zero=False)
        elif start < 0:
            raise ValueError(f"PrecisionPhase.start={start!r} is not valid; use a step >= 0")
        unknown = [name for name in self.high if name not in GEMM_NAMES]
        if unknown or not self.high:
            raise ValueError(f"PrecisionPhase.high={self.high!r} is not valid; use names among {', '.join(GEMM_NAMES)}")
        if not self.layers or not all(isinstance(pattern, str) for pattern in self.layers):
            raise ValueError(f"PrecisionPhase.layers={self.layers!r} is not valid; use module-name patterns such as '*'")

    def first_step(self, total_steps: int | None) -> int:
        """The index of the first step this phase covers."""
        if isinstance(self.start, int):
            return self.start
        if total_steps is None:
            raise ValueError(
                f"PrecisionPhase(start={self.start}) is a share of the run; give "
                "ControllerConfig(total_steps=...) or a step number"
            )
        return math.ceil(self.start * total_steps)

    def covers(self, layer_name: str) -> bool:
        """Whether the layer named ``layer_name`` is in this phase."""
        return any(fnmatch.fnmatchcase(layer_name, pattern) for pattern in self.layers)


@dataclass(frozen=True)
class ControllerConfig:
    """What ``amp8.Controller`` watches and how it acts.

    Attributes:
        interval: optimizer steps between checks; one step in ``interval`` is watched
            (casts then cost two elementwise passes more).
        patience: checks in a row a layer must fail before it moves up a rung.
        urgent_excess: a check where an operand's share flushed or clipped is more than
            this many times its threshold counts as ``patience`` failed checks: the
            layer moves at once (10 % flushed under the default 1 % threshold is no
            batch's noise, and every step it waits trains on a dark cast); None waits
            ``patience`` checks whatever the signals.
        thresholds: when a cast counts as unhealthy.
        max_high_precision_share: the largest share of the FP8 layers' GEMM FLOPs the
            controller may move to high precision (rowwise and block scales stay FP8);
            a move beyond it is refused with a warning, once, and not tried again for
            that layer.
        step_down_after: healthy checks in a row after which a layer goes one rung back
            down (None: never).
        split_wgrad_outliers: a layer whose wgrad casts fail first takes its outlier
            tokens out of wgrad into float32 (``Recipe.wgrad_outlier_split``), before
            wgrad in high precision; False skips that rung.
        adapt: move layers on their signals; False applies the schedule alone.
        schedule: ``PrecisionPhase`` entries, applied whatever the signals say.
        total_steps: the run's optimizer steps, for phases that start at a share of it.
    """

    interval: int = 10
    patience: int = 2
    urgent_excess: float | None = 10.0
    thresholds: HealthThresholds = HealthThresholds()
    max_high_precision_share: float = 0.1
    step_down_after: int | None = None
    split_wgrad_outliers: bool = True
    adapt: bool = True
    schedule: tuple[PrecisionPhase, ...] = ()
    total_steps: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", tuple(self.schedule))
        _check_count("ControllerConfig.interval", self.interval)
        _check_count("ControllerConfig.patience", self.patience)
        _check_count("ControllerConfig.step_down_after", self.step_down_after, optional=True)
        _check_count("ControllerConfig.total_steps", self.total_steps, optional=True)
        _check_fraction("ControllerConfig.max_high_precision_share", self.max_high_precision_share)
        urgent = self.urgent_excess
        if urgent is not None and (isinstance(urgent, bool) or not isinstance(urgent, (int, float)) or not urgent > 1):
            raise ValueError(f"ControllerConfig.urgent_excess={urgent!r} is not valid; use a ratio > 1 or None")
        if not isinstance(self.thresholds, HealthThresholds):
            raise TypeError(f"ControllerConfig.thresholds must be a HealthThresholds, got {type(self.thresholds).__name__}")
        for name in ("adapt", "split_wgrad_outliers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ControllerConfig.{name}={getattr(self, name)!r} is not valid; use True or False")
        for phase in self.schedule:
            if not isinstance(phase, PrecisionPhase):
                raise TypeError(f"ControllerConfig.schedule holds a {type(phase).__name__}; use PrecisionPhase entries")
            phase.first_step(self.total_steps)  # a share without total_steps fails here


@dataclass(frozen=True)
class Move:
    """One change of a layer's GEMM precision.

    Attributes:
        step: optimizer steps done when it happened (it applies from the next one).
        layer: the layer's module name.
        before: the GEMM precision before, e.g. "tensorwise".
        after: the GEMM precision after, e.g. "rowwise" or "block, wgrad high".
        reason: why, e.g. "wgrad input: 63.0 % of nonzero values flushed to zero
            (threshold 1 %)", "schedule from step 270", or "refused: ..." when the cap
            kept the layer where it was (``before == after``).
    """

    step: int
    layer: str
    before: str
    after: str
    reason: str
