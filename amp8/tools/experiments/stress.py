"""An FP8 outlier stress case: a "massive activation" on one token of the byte GPT.

Large language models grow a few huge activations on the first token (Sun et al. 2024,
"Massive activations in large language models"). This module reproduces that on
purpose: the input of the last block's MLP down-projection (``blocks[-1].mlp.proj``, the
GELU output) has its position-0 row multiplied by a gain that grows over training,

    gain(step) = 2 ** (max_log2_gain * min(1, step / (ramp_fraction * steps))),

and the loss leaves position 0 out (its targets become cross-entropy's ignore index).
In exact arithmetic nothing changes: the residual of position 0 after the last block
reaches only position 0's own logits, which the loss ignores, so the forward values of
every other position and every gradient are those of the unstressed model. In FP8 with
one scale per tensor the outlier rows set the scale of the whole input, and every other
row underflows: the last MLP goes dark in fprop and, through the same cast, in wgrad.
Rowwise scales (one per token row, along K) keep fprop; wgrad's casts run along tokens,
one scale per column, and stay dominated by the outlier rows. The case is there for a
precision controller to detect and repair.

The injection is a forward pre-hook on the projection (``OutlierInjection.attach``). It
is registered on the module that holds the projection when it is called, so it must be
attached after ``amp8.initialize`` (which replaces ``nn.Linear`` children by new
``Fp8Linear`` modules, hooks not carried over) and after any other swap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp8.config.recipe import Recipe, Scaling
from amp8.nn.quantizer import CastRule, Quantizer, TensorRole
from amp8.quant.health import GemmOperand, Signal, new_health
from amp8.tools.experiments.gpt import GPTConfig

IGNORE_INDEX = -100
"""The target ``F.cross_entropy`` leaves out (its default ``ignore_index``)."""

MAX_LOG2_GAIN = 32.0
"""The largest gain exponent: the outlier rows (GELU outputs up to ~10, times 2**32)
stay far from float32's overflow also after LayerNorm squares them."""


@dataclass(frozen=True)
class OutlierStress:
    """Where the outlier goes and how it grows.

    The defaults (``studies/stress.py``, ``studies/results/stress-cpu.md``, on the default
    ``amp8 compare`` setup) make O1 with one scale per tensor end 4-7 % above O0 in
    validation loss (O0's seed spread: 0.3 %). Why these numbers: E4M3 flushes what lies
    more than about 2**17.8 below a scale's amax (2**15 of normal range below its max
    448, 2**3 of subnormals), and the other rows' GELU outputs sit within a few binades
    of the outlier row's own values, so near a gain of 2**14 the tensorwise cast starts
    flushing them (10 % of the nonzero values at step 50-60 of 300, 17-20 % of the run)
    and from about 2**19 it flushes every value outside the outlier rows (step 70). The
    ramp goes on to 2**24, five binades past that, so the layer stays dark as the
    activations drift; a controller that acts within 60 steps of the onset still has
    more than half the run to recover.

    Attributes:
        block: index into ``GPT.blocks`` of the block whose MLP projection is stressed.
            Only the last block (-1, the default) leaves training unchanged in exact
            arithmetic; an earlier block feeds the outlier row to later attention.
        position: the token position whose row is scaled; its targets are ignored.
        max_log2_gain: the final gain is ``2 ** max_log2_gain``; 0 to ``MAX_LOG2_GAIN``.
        ramp_fraction: share of the run's steps over which ``log2(gain)`` grows linearly
            from 0 to ``max_log2_gain``; 0 applies the full gain from the first step.
    """

    block: int = -1
    position: int = 0
    max_log2_gain: float = 24.0
    ramp_fraction: float = 0.3

    def __post_init__(self) -> None:
        for name in ("block", "position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"OutlierStress.{name}={value!r} is not valid; use an int")
        if self.position < 0:
            raise ValueError(f"OutlierStress.position={self.position} is not valid; use a position >= 0")
        if isinstance(self.max_log2_gain, bool) or not isinstance(self.max_log2_gain, (int, float)) \
                or not 0 <= self.max_log2_gain <= MAX_LOG2_GAIN:
            raise ValueError(
                f"OutlierStress.max_log2_gain={self.max_log2_gain!r} is not valid; use a number in "
                f"[0, {MAX_LOG2_GAIN:g}] (a larger gain overflows float32 in the final LayerNorm)"
            )
        if isinstance(self.ramp_fraction, bool) or not isinstance(self.ramp_fraction, (int, float)) \
                or not 0 <= self.ramp_fraction <= 1:
            raise ValueError(
                f"OutlierStress.ramp_fraction={self.ramp_fraction!r} is not valid; use a number in [0, 1]"
            )

    def check_model(self, model: GPTConfig) -> None:
        """Raise ``ValueError`` unless ``model`` has the block and the position.

        Raises:
            ValueError: a block index outside ``[-n_layer, n_layer)`` or a position at or
                beyond ``block_size``.
        """
        if not -model.n_layer <= self.block < model.n_layer:
            raise ValueError(
                f"OutlierStress.block={self.block} does not exist in a GPT of n_layer={model.n_layer}; "
                f"use an index in [{-model.n_layer}, {model.n_layer}), e.g. -1 for the last block"
            )
        if self.position >= model.block_size:
            raise ValueError(
                f"OutlierStress.position={self.position} is not a position of a GPT of "
                f"block_size={model.block_size}; use one in [0, {model.block_size})"
            )

    def log2_gain(self, step: int, steps: int) -> float:
        """``log2`` of the gain at step ``step`` (0-based) of a run of ``steps`` steps."""
        ramp_steps = self.ramp_fraction * steps
        progress = 1.0 if ramp_steps <= 0 else min(1.0, step / ramp_steps)
        return self.max_log2_gain * progress

    def gain(self, step: int, steps: int) -> float:
        """The factor on the stressed row at step ``step`` (0-based) of ``steps``."""
        return 2.0 ** self.log2_gain(step, steps)

    def to_dict(self) -> dict[str, Any]:
        """The stress as plain data, for JSON."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for tables and logs."""
        return (f"outlier x2^{self.max_log2_gain:g} on position {self.position} of block {self.block}'s "
                f"MLP down-projection input, ramped over {100 * self.ramp_fraction:g}% of the steps")


def stressed_layer(model: nn.Module, stress: OutlierStress) -> nn.Module:
    """The module that computes ``blocks[stress.block].mlp.proj`` of ``model`` now (an
    ``nn.Linear``, or what ``amp8.initialize`` or torchao put in its place)."""
    return model.blocks[stress.block].mlp.proj  # type: ignore[index, union-attr]


def mask_position(targets: torch.Tensor, position: int) -> torch.Tensor:
    """A copy of ``targets`` (B, T) whose column ``position`` is ``IGNORE_INDEX``."""
    masked = targets.clone()
    masked[:, position] = IGNORE_INDEX
    return masked


class OutlierInjection:
    """Multiplies row ``stress.position`` of the stressed projection's input by
    ``stress.gain(step, steps)``; the training loop sets ``step`` before each forward.

    The gain applies in train and eval mode alike (validation sees the model as it
    trains). Every other element passes through unchanged (multiplied by exactly 1).

    Args:
        stress: where the outlier goes and how it grows.
        steps: the run's number of optimizer steps (the ramp is a share of them).
    """

    def __init__(self, stress: OutlierStress, steps: int) -> None:
        if not isinstance(stress, OutlierStress):
            raise TypeError(f"OutlierInjection takes an OutlierStress, got {type(stress).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"OutlierInjection steps={steps!r} is not valid; use an int >= 1")
        self.stress = stress
        self.steps = steps
        self.step = 0

    @property
    def gain(self) -> float:
        """The gain at the current step."""
        return self.stress.gain(self.step, self.steps)

    def attach(self, model: nn.Module) -> RemovableHandle:
        """Register the injection as a forward pre-hook on ``stressed_layer(model)``.

        Call it after ``amp8.initialize`` and any other layer swap: a hook stays with the
        module it was registered on, and a swap puts a new module in its place.
        Returns the handle that removes it.
        """
        return stressed_layer(model, self.stress).register_forward_pre_hook(self._scale_input)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, K) with row ``stress.position`` of every sequence multiplied by
        the current gain."""
        factor = torch.ones(x.shape[-2], 1, dtype=x.dtype, device=x.device)  # (T, 1)
        factor[self.stress.position] = self.gain
        return x * factor

    def _scale_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self.scale(args[0]), *args[1:])


def underflow_share(x: torch.Tensor, recipe: Recipe, contract_dim: int = 1) -> float:
    """Share of the nonzero elements of ``x`` (any shape; its last dim is the GEMM's K)
    that an FP8 layer's input cast under ``recipe`` flushes to zero, for the GEMM that
    contracts dim ``contract_dim`` of the 2-D view (1: fprop, one scale per token row
    under "rowwise"; 0: wgrad, one scale per column of tokens). Current scaling is
    assumed (a delayed scale depends on history). 0 when ``x`` has no nonzero element.
    The same count as the controller's signal (``amp8.quant.health``).
    """
    x2 = x.detach().reshape(-1, x.shape[-1])  # (M, K)
    rule = dataclasses.replace(CastRule.for_role(recipe, TensorRole.INPUT), scaling=Scaling.CURRENT)
    health = new_health(x.device)
    Quantizer(rule, health=health).watch(x2, contract_dim, (GemmOperand.FPROP_INPUT,))
    return float(health[GemmOperand.FPROP_INPUT, Signal.UNDERFLOW])


CASTS: dict[str, tuple[Recipe, int]] = {
    "tensorwise": (Recipe(), 1),
    "rowwise_fprop": (Recipe(granularity="rowwise"), 1),
    "rowwise_wgrad": (Recipe(granularity="rowwise"), 0),
}
"""The input casts the stress is measured under: name -> (recipe, contracted dim). The
tensorwise cast serves fprop and wgrad alike; rowwise casts per token row for fprop and
per column of tokens for wgrad."""


class UnderflowProbe:
    """Measures ``underflow_share`` of the stressed projection's input under each of
    ``CASTS`` at chosen training steps: a forward pre-hook, attached after the
    ``OutlierInjection`` so it sees the scaled input.

    ``shares[step]`` maps cast names to shares; ``step`` is advanced by the caller
    (``on_step``). Forwards in eval mode (validation) are not measured.

    Args:
        stress: locates the stressed projection.
        steps: the steps to measure at (0-based, before that step's update).
    """

    def __init__(self, stress: OutlierStress, steps: set[int] | frozenset[int]) -> None:
        self.stress = stress
        self.steps = frozenset(steps)
        self.step = 0
        self.shares: dict[int, dict[str, float]] = {}

    def attach(self, model: nn.Module) -> RemovableHandle:
        """Register the probe on ``stressed_layer(model)``; returns its handle."""
        return stressed_layer(model, self.stress).register_forward_pre_hook(self._measure)

    def on_step(self, step: int, loss: float) -> None:
        """Advance to the step after ``step`` (the signature of ``train_run``'s ``on_step``)."""
        self.step = step + 1

    def _measure(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training and self.step in self.steps and self.step not in self.shares:
            x = args[0]
            self.shares[self.step] = {name: underflow_share(x, recipe, dim) for name, (recipe, dim) in CASTS.items()}

