"""``amp8.Controller``: watch every FP8 layer's casts and step a layer up before training
suffers, and apply a precision schedule tied to the step count.

Every ``interval`` optimizer steps, the layers are watched for one step (see
``amp8.quant.health``): each cast of each GEMM operand reports the share of its values it
clips and the share of its nonzero values it flushes to zero. After that step the
controller takes the largest of each signal over the data-parallel ranks (one
all-reduce, so every rank decides alike), and a layer whose signals cross the thresholds
at ``patience`` checks in a row (or at one check, far beyond them: ``urgent_excess``)
takes its next rung up. The rungs start where the
layer's recipe stands and their order depends on which operand fails
(``amp8.monitor.ladder``): a cast under one scale per tensor first gets rowwise scales;
wgrad's casts along tokens (token outliers) take the outlier split, then wgrad in high
precision; fprop's input and dgrad's output gradient take 128-blocks, then high
precision for their GEMMs.

Each move is measured at the next check: where the signals of the operands that made it
move got worse, the controller steps back, never tries that move again for that layer
and takes the next rung. A move beyond the cap on the share of FP8 GEMM FLOPs that may
leave FP8 is refused, logged and warned about once, and not tried again for that layer.
The outlier split (``Recipe.wgrad_outlier_split``) multiplies the tokens whose rows
stand far above the median row in float32 and the rest in FP8. With
``step_down_after``, a layer healthy for that many checks in a row goes one rung back
down. A schedule adds GEMMs in high precision from a given step on (e.g. the last 10 %
of training). Decisions live in each layer's ``gemm_precision`` buffer (the model's
``state_dict``) and the controller's counters, trials and closed moves in the
optimizer's ``state_dict``, so a resumed run decides the same, bit for bit. What the
controller keeps for each layer, and the decisions that need nothing else, are
``amp8.monitor.layer_watch``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch import nn

from amp8.config.controller import GEMM_NAMES, ControllerConfig, Move
from amp8.config.recipe import GRANULARITY_LADDER
from amp8.distributed.data_parallel import DataParallelGroup
from amp8.monitor.ladder import Step, candidate_steps, excess
from amp8.monitor.layer_watch import Failing, LayerWatch, Trial, Verdict
from amp8.nn.linear import Fp8Linear
from amp8.quant.health import Gemm, GemmOperand

STATE_DICT_KEY = "amp8_controller"
"""The key of the controller's state in the optimizer's ``state_dict``."""


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
        self._watches: dict[str, LayerWatch] = {}
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
            name: LayerWatch(GRANULARITY_LADDER.index(layer.gemm_granularity), [False] * len(Gemm))
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
        watch = self._watches[name]
        growth = watch.observe(health)
        if growth is None:  # an overflowing step is skipped; so is its check
            return
        trial, watch.trial = watch.trial, None
        if trial is not None:
            undone = watch.measure(trial, health, self.config)
            if undone is not None:
                self._note(name, undone.reason)
                self._take_next_rung(name, watch, undone.failing)
                return
            # Measured and kept: a layer that still fails takes its next rung now.
            watch.failed_checks = self.config.patience - 1
        violations = self.config.thresholds.violations(health, growth)
        urgent = self.config.urgent_excess is not None and any(
            excess(health, (operand,), self.config.thresholds) > self.config.urgent_excess
            for operand, _ in violations
        )
        verdict = watch.count(bool(violations), urgent, self.config)
        if verdict is Verdict.STEP_UP:
            self._step_up(name, watch, violations, health)
        elif verdict is Verdict.STEP_DOWN:
            self._step_down(name, watch)

    def _step_up(
        self, name: str, watch: LayerWatch, violations: list[tuple[GemmOperand, str]], health: torch.Tensor
    ) -> None:
        high_now = self._layers[name].high_precision_gemms
        self._take_next_rung(name, watch, [
            Failing(operand, why, excess(health, (operand,), self.config.thresholds))
            for operand, why in violations if not high_now[operand.gemm]
        ])

    def _take_next_rung(self, name: str, watch: LayerWatch, failing: list[Failing]) -> None:
        """Take the first rung of ``candidate_steps`` for the ``failing`` operands that is
        not closed and is within the cap, and open its trial; refuse (and close) those
        beyond the cap on the way."""
        reasons = {entry.operand: entry.why for entry in failing}
        steps = candidate_steps(watch.state, set(reasons), split=self.config.split_wgrad_outliers)
        for step in steps:
            if step.label in watch.closed:
                continue
            share = self.high_precision_share() + (
                self._moved_flops(name, step.state.high, step.state.split)
                - self._moved_flops(name, watch.high, watch.split)
            ) / self._fp8_flops()
            if share > self.config.max_high_precision_share + 1e-12:
                self._refuse(name, watch, step, share)
                continue
            before = watch.state
            watch.set_state(step.state)
            # A GEMM moved to high precision loses nothing to its casts, whatever their
            # signals say (they are watched as the casts it would get): no trial.
            watch.trial = None if step.state.high != before.high else Trial.of(step, before, failing)
            operand = step.operands[0]
            self._note(name, f"{operand.label}: {reasons[operand]}; {step.label}")
            return

    def _refuse(self, name: str, watch: LayerWatch, step: Step, share: float) -> None:
        watch.closed.append(step.label)
        reason = (f"refused: {step.label} would put {100 * share:.1f} % of FP8 GEMM FLOPs in "
                  f"high precision, above the cap of {100 * self.config.max_high_precision_share:g} %; "
                  "not tried again for this layer")
        current = self._layers[name].gemm_description
        self._log(Move(self.step, name, current, current, reason))
        if not watch.cap_warned:
            watch.cap_warned = True
            warnings.warn(
                f"amp8.Controller: layer {name!r} fails its FP8 health checks but is kept in FP8: {reason}. "
                "Raise ControllerConfig.max_high_precision_share to let it move", stacklevel=4,
            )

    def _step_down(self, name: str, watch: LayerWatch) -> None:
        if watch.step_down(GRANULARITY_LADDER.index(self._layers[name].recipe.granularity)):
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
                    high[GEMM_NAMES.index(gemm)] = True
        return high

    def _apply_layer(self, name: str) -> bool:
        """Set the layer's GEMM precision to what its rung and the schedule say; True if
        it changed."""
        layer, watch = self._layers[name], self._watches[name]
        base = layer.recipe.override_linear_precision
        high = tuple(b or c or s for b, c, s in zip(base, watch.high, self._scheduled_high(name)))
        granularity = GRANULARITY_LADDER[watch.rung]
        split = layer.recipe.wgrad_outlier_split or watch.split
        if (granularity, high, split) == (
            layer.gemm_granularity, layer.high_precision_gemms, layer.gemm_recipe.wgrad_outlier_split
        ):
            return False
        layer.set_gemm_precision(granularity, high, split)
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

    def _moved_flops(self, name: str, high: list[bool] | tuple[bool, ...], split: bool) -> float:
        """FLOPs per token of layer ``name`` in high precision with the GEMMs ``high``
        there and, where ``split``, wgrad's outlier tokens."""
        layer = self._layers[name]
        outliers = layer.recipe.wgrad_outlier_share if split and not high[Gemm.WGRAD] else 0.0
        return self._flops(layer) * (sum(high) + outliers)

    def high_precision_share(self) -> float:
        """The share of the FP8 layers' GEMM FLOPs (per token) that the controller has
        moved to high precision (the recipe's and the schedule's own are not counted)."""
        moved = sum(self._moved_flops(name, w.high, w.split) for name, w in self._watches.items())
        return moved / self._fp8_flops()

    def fp8_share(self) -> float:
        """The share of the FP8 layers' GEMM FLOPs (per token) that run in FP8 now."""
        high = sum(self._moved_flops(name, layer.high_precision_gemms, layer.gemm_recipe.wgrad_outlier_split)
                   for name, layer in self._layers.items())
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
            "layers": {name: watch.to_state() for name, watch in self._watches.items()},
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
        self._watches = {name: LayerWatch.from_state(saved_layers[name]) for name in self._watches}
        self.moves = [Move(**move) for move in state["moves"]]
        for name, layer in self._layers.items():
            layer.gemm_moves = [move for move in self.moves if move.layer == name]
        self._apply()
