"""``amp8.Controller``: watch every FP8 layer's casts and step a layer up before training
suffers, and apply a precision schedule tied to the step count.

Every ``interval`` optimizer steps, the layers are watched for one step (see
``amp8.health``): each cast of each GEMM operand reports the share of its values it
clips and the share of its nonzero values it flushes to zero. After that step the
controller takes the largest of each signal over the data-parallel ranks (one
all-reduce, so every rank decides alike), and a layer whose signals cross the thresholds
at ``patience`` checks in a row goes one rung up:

    tensorwise -> rowwise -> 128-block -> high precision for the offending GEMMs

The last rung moves only the GEMMs whose operands crossed a threshold, as
``Recipe.override_linear_precision`` would, within a cap on the share of FP8 GEMM FLOPs
that may leave FP8. With ``step_down_after``, a layer healthy for that many checks in a
row goes one rung back down. A schedule adds GEMMs in high precision from a given step
on (e.g. the last 10 % of training). Decisions live in each layer's ``gemm_precision``
buffer (the model's ``state_dict``) and the controller's counters in the optimizer's
``state_dict``, so a resumed run decides the same, bit for bit.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .comm.data_parallel import DataParallelGroup
from .health import Gemm, GemmOperand, Signal
from .nn.linear import Fp8Linear
from .recipe import GRANULARITY_LADDER

STATE_DICT_KEY = "amp8_controller"
"""The key of the controller's state in the optimizer's ``state_dict``."""
_GEMM_NAMES = tuple(gemm.name.lower() for gemm in Gemm)


def _check_fraction(field: str, value: Any, *, allow_zero: bool = True) -> None:
    low_ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and value <= 1):
        bound = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{field}={value!r} is not valid; use a share in {bound}")


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
        high: GEMM names among "fprop", "dgrad", "wgrad".
        layers: patterns of module names (as ``model.named_modules()`` gives them).
    """

    start: int | float
    high: tuple[str, ...] = ("fprop",)
    layers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "high", tuple(self.high))
        object.__setattr__(self, "layers", tuple(self.layers))
        start = self.start
        if isinstance(start, bool) or not isinstance(start, (int, float)):
            raise ValueError(f"PrecisionPhase.start={start!r} is not valid; use a step (int) or a share (float)")
        if isinstance(start, float):
            _check_fraction("PrecisionPhase.start", start, allow_zero=False)
        elif start < 0:
            raise ValueError(f"PrecisionPhase.start={start!r} is not valid; use a step >= 0")
        unknown = [name for name in self.high if name not in _GEMM_NAMES]
        if unknown or not self.high:
            raise ValueError(f"PrecisionPhase.high={self.high!r} is not valid; use names among {', '.join(_GEMM_NAMES)}")
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
        thresholds: when a cast counts as unhealthy.
        max_high_precision_share: the largest share of the FP8 layers' GEMM FLOPs the
            controller may move to high precision (rowwise and block scales stay FP8);
            a move beyond it is refused with a warning.
        step_down_after: healthy checks in a row after which a layer goes one rung back
            down (None: never).
        adapt: move layers on their signals; False applies the schedule alone.
        schedule: ``PrecisionPhase`` entries, applied whatever the signals say.
        total_steps: the run's optimizer steps, for phases that start at a share of it.
    """

    interval: int = 10
    patience: int = 2
    thresholds: HealthThresholds = HealthThresholds()
    max_high_precision_share: float = 0.1
    step_down_after: int | None = None
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
        if not isinstance(self.thresholds, HealthThresholds):
            raise TypeError(f"ControllerConfig.thresholds must be a HealthThresholds, got {type(self.thresholds).__name__}")
        if not isinstance(self.adapt, bool):
            raise ValueError(f"ControllerConfig.adapt={self.adapt!r} is not valid; use True or False")
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


@dataclass
class _LayerWatch:
    """The controller's bookkeeping for one layer (all of it in ``state_dict``)."""

    rung: int
    high: list[bool]
    failed_checks: int = 0
    passed_checks: int = 0
    last_amax: list[float] = dataclasses.field(default_factory=lambda: [0.0] * len(GemmOperand))
    cap_warned: bool = False
    peak_underflow: float = 0.0
    peak_saturated: float = 0.0


class Controller:
    """Watches the FP8 layers of one model and moves their GEMM precision (see the
    module docstring). Pass it to ``amp8.initialize(..., controller=amp8.Controller())``;
    it then acts after every ``optimizer.step()`` (a step post-hook) and saves its state
    with ``optimizer.state_dict()``. One controller serves one model.

    Attributes:
        config: the ``ControllerConfig``.
        step: optimizer steps done since the controller was attached.
        moves: every ``Move`` so far, in order.
    """

    def __init__(self, config: ControllerConfig | None = None) -> None:
        if config is None:
            config = ControllerConfig()
        if not isinstance(config, ControllerConfig):
            raise TypeError(f"config must be an amp8.ControllerConfig, got {type(config).__name__}")
        self.config = config
        self.step = 0
        self.moves: list[Move] = []
        self._layers: dict[str, Fp8Linear] = {}
        self._watches: dict[str, _LayerWatch] = {}
        self._data_parallel: DataParallelGroup | None = None
        self._attached = False

    # -- wiring ------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether the controller watches a model already."""
        return self._attached

    def attach(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, data_parallel: DataParallelGroup | None = None
    ) -> None:
        """Watch ``model``'s FP8 layers and act after each step of ``optimizer``;
        ``data_parallel`` (if any) is the group whose ranks must decide alike.
        ``amp8.initialize`` calls this.

        Raises:
            RuntimeError: the controller already watches a model.
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        """
        if self._attached:
            raise RuntimeError("this amp8.Controller already watches a model; build one Controller per model")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "amp8.initialize(controller=...) needs the optimizer: the controller acts after each "
                f"optimizer step; got {type(optimizer).__name__}"
            )
        self._layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
        self._watches = {
            name: _LayerWatch(GRANULARITY_LADDER.index(layer.gemm_granularity), [False] * len(Gemm))
            for name, layer in self._layers.items()
        }
        self._data_parallel = data_parallel
        optimizer.register_step_post_hook(lambda *_: self.after_step())
        optimizer.register_state_dict_post_hook(self._save_into)
        optimizer.register_load_state_dict_pre_hook(self._load_from)
        self._attached = True
        self._apply()

    def _save_into(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[STATE_DICT_KEY] = self.state_dict()
        return state_dict

    def _load_from(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved = state_dict.pop(STATE_DICT_KEY, None)
        if saved is not None:
            self.load_state_dict(saved)
        return state_dict

    # -- one step ----------------------------------------------------------------------
    def after_step(self) -> None:
        """Count a step; after a watched step, check the signals and move layers; apply
        the schedule; watch the next step if it is due. The optimizer's step post-hook
        calls this."""
        self.step += 1
        if self.config.adapt and self.step % self.config.interval == 0:
            self._check()
        self._apply()

    def _check(self) -> None:
        names = list(self._layers)
        if not names:
            return
        health = torch.stack([self._layers[name].health for name in names]).float()
        # A NaN would not survive a max over ranks: count it as the worst value.
        health = torch.nan_to_num(health, nan=math.inf)
        if self._data_parallel is not None:
            health = self._data_parallel.max_over_ranks(health)
        health = health.cpu()
        for name in names:
            self._layers[name].health.zero_()
        for name, layer_health in zip(names, health):
            self._check_layer(name, layer_health)

    def _check_layer(self, name: str, health: torch.Tensor) -> None:
        amax = health[:, Signal.AMAX]
        if not torch.isfinite(amax).all():  # an overflowing step is skipped; so is its check
            return
        watch = self._watches[name]
        last = torch.tensor(watch.last_amax)
        growth = torch.where((last > 0) & (amax > 0), amax / last.clamp(min=1e-30), torch.ones_like(amax))
        watch.last_amax = [float(value) if value > 0 else float(old) for value, old in zip(amax, last)]
        watch.peak_underflow = max(watch.peak_underflow, float(health[:, Signal.UNDERFLOW].max()))
        watch.peak_saturated = max(watch.peak_saturated, float(health[:, Signal.SATURATED].max()))
        violations = self.config.thresholds.violations(health, growth)
        if violations:
            watch.failed_checks, watch.passed_checks = watch.failed_checks + 1, 0
        else:
            watch.failed_checks, watch.passed_checks = 0, watch.passed_checks + 1
        if watch.failed_checks >= self.config.patience:
            watch.failed_checks = 0
            self._step_up(name, watch, violations)
        elif self.config.step_down_after is not None and watch.passed_checks >= self.config.step_down_after:
            watch.passed_checks = 0
            self._step_down(name, watch)

    def _step_up(self, name: str, watch: _LayerWatch, violations: list[tuple[GemmOperand, str]]) -> None:
        operand, why = violations[0]
        reason = f"{operand.label}: {why}"
        if watch.rung + 1 < len(GRANULARITY_LADDER):
            watch.rung += 1
            self._note(name, reason)
            return
        gemms = sorted({op.gemm for op, _ in violations if not watch.high[op.gemm]})
        if not gemms:
            return  # already in high precision where it fails
        layer = self._layers[name]
        share = self.high_precision_share() + len(gemms) * self._flops(layer) / self._fp8_flops()
        if share > self.config.max_high_precision_share + 1e-12:
            self._refuse(name, watch, gemms, share)
            return
        for gemm in gemms:
            watch.high[gemm] = True
        self._note(name, reason)

    def _refuse(self, name: str, watch: _LayerWatch, gemms: list[Gemm], share: float) -> None:
        wanted = "+".join(_GEMM_NAMES[gemm] for gemm in gemms)
        reason = (f"refused: {wanted} in high precision would put {100 * share:.1f} % of FP8 GEMM FLOPs in "
                  f"high precision, above the cap of {100 * self.config.max_high_precision_share:g} %")
        current = self._layers[name].gemm_description
        self._log(Move(self.step, name, current, current, reason))
        if not watch.cap_warned:
            watch.cap_warned = True
            warnings.warn(
                f"amp8.Controller: layer {name!r} fails its FP8 health checks but is kept in FP8: {reason}. "
                "Raise ControllerConfig.max_high_precision_share to let it move", stacklevel=3,
            )

    def _step_down(self, name: str, watch: _LayerWatch) -> None:
        base = GRANULARITY_LADDER.index(self._layers[name].recipe.granularity)
        if any(watch.high):
            watch.high = [False] * len(Gemm)
        elif watch.rung > base:
            watch.rung -= 1
        else:
            return
        self._note(name, f"healthy for {self.config.step_down_after} checks in a row")

    def _note(self, name: str, reason: str) -> None:
        """Apply ``name``'s new rung now and log the move."""
        layer = self._layers[name]
        before = layer.gemm_description
        self._apply_layer(name)
        self._log(Move(self.step, name, before, layer.gemm_description, reason))

    def _log(self, move: Move) -> None:
        self.moves.append(move)
        self._layers[move.layer].gemm_moves.append(move)

    # -- what each layer runs ------------------------------------------------------------
    def _scheduled_high(self, name: str) -> list[bool]:
        high = [False] * len(Gemm)
        for phase in self.config.schedule:
            if self.step >= phase.first_step(self.config.total_steps) and phase.covers(name):
                for gemm in phase.high:
                    high[_GEMM_NAMES.index(gemm)] = True
        return high

    def _apply_layer(self, name: str) -> bool:
        """Set the layer's GEMM precision to what its rung and the schedule say; True if
        it changed."""
        layer, watch = self._layers[name], self._watches[name]
        base = layer.recipe.override_linear_precision
        high = tuple(b or c or s for b, c, s in zip(base, watch.high, self._scheduled_high(name)))
        granularity = GRANULARITY_LADDER[watch.rung]
        if (granularity, high) == (layer.gemm_granularity, layer.high_precision_gemms):
            return False
        layer.set_gemm_precision(granularity, high)
        return True

    def _apply(self) -> None:
        """Apply rungs and the schedule to every layer, and watch the next step if a
        check follows it."""
        watch_next = self.config.adapt and (self.step + 1) % self.config.interval == 0
        for name, layer in self._layers.items():
            before = layer.gemm_description
            if self._apply_layer(name):
                self._log(Move(self.step, name, before, layer.gemm_description, "schedule"))
            layer.watch_health = watch_next

    # -- accounting --------------------------------------------------------------------
    @staticmethod
    def _flops(layer: Fp8Linear) -> int:
        """FLOPs of one GEMM of ``layer`` per token, up to the factor 2 all share."""
        return layer.in_features * layer.out_features

    def _fp8_flops(self) -> int:
        return max(1, len(Gemm) * sum(self._flops(layer) for layer in self._layers.values()))

    def high_precision_share(self) -> float:
        """The share of the FP8 layers' GEMM FLOPs (per token) that the controller has
        moved to high precision (the recipe's and the schedule's own are not counted)."""
        moved = sum(self._flops(self._layers[name]) * sum(w.high) for name, w in self._watches.items())
        return moved / self._fp8_flops()

    def fp8_share(self) -> float:
        """The share of the FP8 layers' GEMM FLOPs (per token) that run in FP8 now."""
        high = sum(self._flops(layer) * sum(layer.high_precision_gemms) for layer in self._layers.values())
        return 1.0 - high / self._fp8_flops()

    def peak_signals(self) -> dict[str, dict[str, float]]:
        """The largest share flushed to zero and clipped that any operand of each layer
        showed at any check so far, by module name: how close a run came to the
        thresholds."""
        return {name: {"underflow": watch.peak_underflow, "saturated": watch.peak_saturated}
                for name, watch in self._watches.items()}

    def rungs(self) -> dict[str, str]:
        """Each FP8 layer's GEMM precision now, in words, by module name."""
        return {name: layer.gemm_description for name, layer in self._layers.items()}

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step count, each layer's rung and counters, and the moves so far (plain
        Python values)."""
        return {
            "step": self.step,
            "layers": {name: dataclasses.asdict(watch) for name, watch in self._watches.items()},
            "moves": [dataclasses.asdict(move) for move in self.moves],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved and apply it to the layers.

        Raises:
            ValueError: the saved layers are not this model's FP8 layers.
        """
        saved_layers = state["layers"]
        if set(saved_layers) != set(self._watches):
            missing = sorted(set(self._watches) - set(saved_layers))
            extra = sorted(set(saved_layers) - set(self._watches))
            raise ValueError(
                f"the controller state does not match this model's FP8 layers (missing {missing}, "
                f"unknown {extra}); load a checkpoint of the same model and module_filter"
            )
        self.step = int(state["step"])
        self._watches = {name: _LayerWatch(**saved_layers[name]) for name in self._watches}
        self.moves = [Move(**move) for move in state["moves"]]
        for name, layer in self._layers.items():
            layer.gemm_moves = [move for move in self.moves if move.layer == name]
        self._apply()
