"""How each tensor of an ``Fp8Linear``'s GEMMs is scaled and cast to FP8.

A ``Quantizer`` serves one tensor role. It is built once from the recipe and holds frozen
settings (a ``CastRule``) and, for the roles whose scales the layer records, the layer's
``scale`` and ``amax_history`` buffers with the role's row in them, which it updates in
place (so a compiled graph writes them too). It never holds the layer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, NamedTuple

import torch

from amp8.config.formats import FP4, forward_dtype, gradient_dtype
from amp8.config.recipe import AmaxAlgo, Granularity, Microscaling, Recipe, Scaling, operand_tile
from amp8.quant import hadamard, scaling
from amp8.quant.health import GemmOperand, block_cast_health, cast_health, record_health
from amp8.tensor import block_scaled as microscaling
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor


class TensorRole(IntEnum):
    """The role of a tensor in an ``Fp8Linear``'s GEMMs; also its row in the layer's
    ``scale`` and ``amax_history`` buffers."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


@dataclass(frozen=True)
class CastRule:
    """Everything about one role's FP8 cast except its tensors.

    Attributes:
        dtype: the FP8 dtype of the cast.
        scaling: where the scale comes from (see ``amp8.config.Scaling``).
        margin: scales are divided by ``2**margin``.
        power_of_2: scales are rounded down to a power of two.
        amax_algo: how delayed scaling reduces the amax history.
        granularity: how many scales a cast takes (see ``amp8.config.Granularity``).
        block_size: the recipe's tile edge under "block".
        square_blocks: the role takes ``block_size`` squares under "block" (weights).
        microscaled: casts give ``BlockScaledTensor`` in the microscaled format of
            ``dtype`` (MXFP8 for FP8, NVFP4 for packed FP4).
        stochastic: microscaled FP4 casts round stochastically (output gradients).
    """

    dtype: torch.dtype
    scaling: Scaling
    margin: int
    power_of_2: bool
    amax_algo: AmaxAlgo
    granularity: Granularity
    block_size: int
    square_blocks: bool
    microscaled: bool = False
    stochastic: bool = False

    @classmethod
    def for_role(cls, recipe: Recipe, role: TensorRole) -> "CastRule":
        """The rule ``recipe`` gives the tensor in ``role``: E5M2 for output gradients
        under HYBRID, E4M3 otherwise."""
        fmt = recipe.fp8_format
        dtype = gradient_dtype(fmt) if role is TensorRole.GRAD_OUTPUT else forward_dtype(fmt)
        return cls(
            dtype=FP4 if recipe.microscaling is Microscaling.NVFP4 else dtype,
            scaling=recipe.scaling,
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
            amax_algo=recipe.amax_compute_algo,
            granularity=recipe.granularity,
            block_size=recipe.block_size,
            square_blocks=role is TensorRole.WEIGHT and recipe.square_weight_blocks,
            microscaled=recipe.microscaling is not Microscaling.NONE,
            stochastic=recipe.stochastic_grad_rounding and role is TensorRole.GRAD_OUTPUT,
        )

    @property
    def scale_block_size(self) -> int:
        """Elements per block edge of the scales a cast gives (0 unless "block")."""
        return self.block_size if self.granularity is Granularity.BLOCK else 0

    def tile(self, shape: tuple[int, ...], contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile sharing one scale when a tensor of ``shape`` is cast for a GEMM
        contracting its dim ``contract_dim``; None for one scale per tensor."""
        return operand_tile(self.granularity, self.block_size, shape, contract_dim, weight=self.square_blocks)

    def scale_from_amax(self, amax: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The scales for ``amax`` (elementwise), keeping ``previous`` (default 1) where an
        amax is zero or not finite."""
        return scaling.scale_from_amax(
            amax, self.dtype, margin=self.margin, power_of_2=self.power_of_2, previous=previous
        )


@dataclass(frozen=True, eq=False)
class Quantizer:
    """Casts the tensors of one role to FP8 under its ``CastRule``.

    Attributes:
        rule: the frozen settings of the cast.
        scales: the layer's ``scale`` buffer (one row per ``TensorRole``), or None for a
            role that records nothing (the weight gradient).
        histories: the layer's ``amax_history`` buffer, or None likewise.
        row: the role's row in ``scales`` and ``histories``.
        health: the layer's ``health`` buffer (see ``amp8.quant.health``), or None: casts
            asked to watch their operands write their signals there (a microscaled
            cast through ``block_cast_health``).
        rotation: the layer's random Hadamard matrix (``Recipe.wgrad_hadamard``): a
            microscaled cast for wgrad (``contract_dim=0``) casts ``Q^T x`` instead of
            ``x`` (see ``amp8.quant.hadamard``), for the input and output gradient alike, so
            wgrad's product is unchanged.
    """

    rule: CastRule
    scales: torch.Tensor | None = None
    histories: torch.Tensor | None = None
    row: int = 0
    health: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule.scaling is Scaling.DELAYED and self.histories is None:
            raise ValueError("a Quantizer with delayed scaling needs an amax history buffer (histories)")

    def next_scale(self, x: torch.Tensor, contract_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` the next cast of the 2-D ``x`` for a GEMM contracting its dim
        ``contract_dim`` would use; changes nothing.

        Current scaling takes the scale from ``amax(x)`` (per tile under fine-grained
        granularities; ``amax`` is then the largest of them). Delayed scaling takes it
        from the amax history, falling back to ``amax(x)`` while the history is still
        empty. No scaling always gives 1. A tensorwise scale keeps the last recorded one
        where the amax is zero or not finite.
        """
        if self.rule.microscaled:
            decode = self._block_cast(self._block_source(x, contract_dim), contract_dim).decode_scales()
            return torch.where(decode > 0, decode.reciprocal(), 1.0), scaling.amax(x)
        tile = self.rule.tile(tuple(x.shape), contract_dim)
        amaxes = scaling.tile_amax(x, tile)
        previous = self.scales[self.row] if tile is None and self.scales is not None else None
        return _SCALE_RULES[self.rule.scaling](self, amaxes, previous), amaxes.amax()

    def cast(
        self,
        x: torch.Tensor,
        contract_dim: int = 1,
        *,
        record: bool = False,
        update_history: bool = False,
        watch: tuple[GemmOperand, ...] = (),
    ) -> ScaledTensor | BlockScaledTensor:
        """``x`` (2-D) in FP8 with its scales, for a GEMM contracting its dim ``contract_dim``
        (a ``BlockScaledTensor`` under microscaling).

        With ``record``, the scale (the smallest, under fine-grained granularities) goes
        to the role's row of ``scales`` and, with ``update_history`` too, the amax to its
        history, both in place; an empty ``x`` records nothing. The cast's health signals
        go to the rows of ``health`` named by ``watch`` (see ``amp8.quant.health``).
        """
        if self.rule.microscaled:
            source = self._block_source(x, contract_dim)
            cast = self._block_cast(source, contract_dim)
            if record and x.numel() > 0:
                decode = cast.decode_scales()
                self._record(decode.amax().reciprocal(), scaling.amax(x), update_history)
            if watch:
                self._record_health(watch, block_cast_health(source, cast))
            return cast
        scale, current_amax = self.next_scale(x, contract_dim)
        if record and x.numel() > 0:  # an empty batch says nothing about the range
            self._record(scale, current_amax, update_history)
        block_size = self.rule.scale_block_size
        full_scale = scaling.expand_scale(scale, tuple(x.shape), block_size)
        data = scaling.quantize(x, full_scale, self.rule.dtype)
        if watch:
            self._record_health(watch, cast_health(x, full_scale, data))
        return ScaledTensor(data, scale, block_size)

    def watch(self, x: torch.Tensor, contract_dim: int, operands: tuple[GemmOperand, ...]) -> None:
        """Write the health signals of the cast ``x`` would get into the rows of
        ``operands``, and nothing else: a GEMM that runs in high precision is still
        watched, so its layer knows when FP8 would serve it again."""
        self.cast(x, contract_dim, watch=operands)

    def _record_health(self, operands: tuple[GemmOperand, ...], signals: torch.Tensor) -> None:
        if self.health is None:
            raise ValueError("this Quantizer has no health buffer to watch casts into; cast with watch=()")
        record_health(self.health, operands, signals)

    def _block_source(self, x: torch.Tensor, contract_dim: int) -> torch.Tensor:
        """What a microscaled cast of ``x`` quantizes: ``x`` rotated for wgrad (see
        ``rotation``), else ``x``."""
        if contract_dim == 0 and self.rotation is not None:
            return hadamard.rotate_rows(x, self.rotation)
        return x

    def _block_cast(self, x: torch.Tensor, contract_dim: int) -> BlockScaledTensor:
        """The microscaled cast of ``x`` as it is (``_block_source`` rotated it already)."""
        tile = self.rule.tile(tuple(x.shape), contract_dim)
        key = microscaling.data_noise_key(x) if self.rule.stochastic else None
        return microscaling.quantize_block_scaled(
            x, self.rule.dtype, tile, margin=self.rule.margin, noise_key=key  # type: ignore[arg-type]
        )

    def _record(self, scale: torch.Tensor, current_amax: torch.Tensor, update_history: bool) -> None:
        if self.scales is None or self.histories is None:
            raise ValueError("this Quantizer has no scale buffers to record into; cast with record=False")
        with torch.no_grad():
            self.scales[self.row] = scale.amin()
            if update_history:
                finite_amax = torch.where(torch.isfinite(current_amax), current_amax, 0.0)
                self.histories[self.row] = scaling.push_history(self.histories[self.row], finite_amax)


ScaleRule = Callable[[Quantizer, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _unit_scale(quantizer: Quantizer, amaxes: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(amaxes)


def _current_scale(quantizer: Quantizer, amaxes: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    return quantizer.rule.scale_from_amax(amaxes, previous)


def _delayed_scale(quantizer: Quantizer, amaxes: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    fresh = _current_scale(quantizer, amaxes, previous)
    history = quantizer.histories[quantizer.row]  # type: ignore[index]  # checked at construction
    delayed = quantizer.rule.scale_from_amax(scaling.history_amax(history, quantizer.rule.amax_algo), previous)
    return torch.where(history.amax() > 0, delayed, fresh)


_SCALE_RULES: dict[Scaling, ScaleRule] = {
    Scaling.NONE: _unit_scale,
    Scaling.CURRENT: _current_scale,
    Scaling.DELAYED: _delayed_scale,
}
"""How each scaling kind picks a scale from a tensor's tile amaxes."""


class LinearQuantizers(NamedTuple):
    """The quantizers of one ``Fp8Linear``: one per ``TensorRole`` (see ``of``). The
    weight gradient is stored at the stored weight's ``GradLayout``."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer

    @classmethod
    def build(
        cls,
        recipe: Recipe,
        scales: torch.Tensor,
        histories: torch.Tensor,
        health: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> "LinearQuantizers":
        """Quantizers for ``recipe`` over a layer's ``scale`` (roles,), ``amax_history``
        (roles, L) and ``health`` buffers. The input's and output gradient's wgrad casts
        are rotated by ``rotation`` where one is given (``Recipe.wgrad_hadamard``)."""
        recorded = [
            Quantizer(CastRule.for_role(recipe, role), scales, histories, role.value, health=health,
                      rotation=None if role is TensorRole.WEIGHT else rotation)
            for role in TensorRole
        ]
        return cls(*recorded)

    def of(self, role: TensorRole) -> Quantizer:
        """The quantizer of the tensor in ``role``."""
        return self[role.value]  # an IntEnum index is not traced by torch.compile
