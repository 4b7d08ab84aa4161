"""How each tensor of an ``Fp8Linear``'s GEMMs is scaled and cast to FP8.

A ``Quantizer`` serves one tensor role. It is built once from the recipe and holds frozen
settings (a ``CastRule``) and, for the roles whose scales the layer records, the layer's
``scale`` and ``amax_history`` buffers with the role's row in them, which it updates in
place (so a compiled graph writes them too). It never holds the layer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from amp8.config.recipe import Recipe, Scaling
from amp8.nn.cast_kernels import CastSpec, check_layouts, decoded, record_scale, run_casts, tile_scales
from amp8.nn.cast_rule import CastRule, TensorRole
from amp8.quant import hadamard, scaling
from amp8.quant.codec import Layout
from amp8.quant.health import GemmOperand, block_cast_health, record_health
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, pad_rows
from amp8.tensor import block_scaled as microscaling
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor


class OperandCast(NamedTuple):
    """One read of an operand, cast (``Quantizer.cast_layouts``): its FP8 rows and its
    column-major copy, each None unless asked for."""

    rows: ScaledTensor | BlockScaledTensor | None
    columns: ScaledTensor | None


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
        compiled: casts run as compiled kernels outside ``torch.compile`` (see
            ``amp8._compiled.runs_compiled``); the bits are the same.
    """

    rule: CastRule
    scales: torch.Tensor | None = None
    histories: torch.Tensor | None = None
    row: int = 0
    health: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    compiled: bool = False

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
        return tile_scales(self.rule, x, contract_dim, self.scales, self.histories, self.row)

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
        return self.cast_layouts(x, contract_dim, record=record, update_history=update_history, watch=watch).rows  # type: ignore[return-value]

    def cast_layouts(
        self,
        x: torch.Tensor,
        contract_dim: int = 1,
        *,
        record: bool = False,
        update_history: bool = False,
        watch: tuple[GemmOperand, ...] = (),
        rows: bool = True,
        columns: bool = False,
        padded: bool = False,
        stored_as: Layout | None = None,
        stored_scale: torch.Tensor | None = None,
        transposed: bool = False,
        replay: bool = False,
    ) -> OperandCast:
        """``cast``, with the FP8 data in the layouts the GEMMs read, from one read of
        ``x`` (see ``amp8.nn.cast_kernels.CastSpec``), run as compiled kernels where
        ``compiled`` says (``amp8.nn.cast_kernels.run_casts``). A microscaled cast runs
        eagerly and gives one layout, rows or columns. With ``stored_as``, ``x`` is stored
        data under that codec, with scales ``stored_scale``, decoded (and ``transposed``)
        in the cast; with ``replay``, the cast repeats one made before (``CastSpec.replay``).
        ``cast_operands`` makes several casts in one call."""
        spec = CastSpec(self.rule, self.row, contract_dim, record, record and update_history, watch, rows, columns,
                        padded, stored_as, transposed, replay)
        return cast_operands((CastRequest(self, x, spec, stored_scale),))[0]

    def request(self, x: torch.Tensor, stored_scale: torch.Tensor | None = None, **settings: Any) -> "CastRequest":
        """A cast of ``x`` for ``cast_operands``, with the settings of a ``CastSpec`` (its
        fields after ``rule`` and ``row``; ``update_history`` counts only with
        ``record``)."""
        return CastRequest(self, x, CastSpec(self.rule, self.row, **settings), stored_scale)

    def _microscaled_layouts(self, request: "CastRequest") -> OperandCast:
        """The microscaled cast ``request`` asks for, in the one layout it gives."""
        spec = request.spec
        check_layouts(spec.rows, spec.columns, spec.padded, one_scale=False)
        x = decoded(spec.stored_as, spec.transposed, request.x, request.stored_scale)
        cast = self._microscaled_cast(pad_rows(x, GEMM_ALIGNMENT) if spec.padded else x, spec.contract_dim,
                                      spec.records, spec.update_history, spec.watch)
        return OperandCast(cast if spec.rows else None, cast.with_data(column_major(cast.data)) if spec.columns else None)

    def _check_request(self, request: "CastRequest") -> None:
        """Raise ``ValueError`` where ``request`` asks for buffers this quantizer has not."""
        if request.spec.records and request.x.numel() > 0 and (self.scales is None or self.histories is None):
            raise ValueError("this Quantizer has no scale buffers to record into; cast with record=False")
        if request.spec.watch and self.health is None:
            raise ValueError("this Quantizer has no health buffer to watch casts into; cast with watch=()")

    def _microscaled_cast(
        self, x: torch.Tensor, contract_dim: int, record: bool, update_history: bool, watch: tuple[GemmOperand, ...]
    ) -> BlockScaledTensor:
        """The microscaled cast of ``x`` (rotated for wgrad, see ``rotation``), recording
        and watching as ``cast_layouts`` says."""
        source = self._block_source(x, contract_dim)
        cast = self._block_cast(source, contract_dim)
        if record and x.numel() > 0:
            record_scale(self.scales, self.histories, self.row, cast.decode_scales().amax().reciprocal(),  # type: ignore[arg-type]
                         scaling.amax(x), update_history)
        if watch:
            record_health(self.health, watch, block_cast_health(source, cast))  # type: ignore[arg-type]
        return cast

    def watch(self, x: torch.Tensor, contract_dim: int, operands: tuple[GemmOperand, ...]) -> None:
        """Write the health signals of the cast ``x`` would get into the rows of
        ``operands``, and nothing else: a GEMM that runs in high precision is still
        watched, so its layer knows when FP8 would serve it again."""
        self.cast(x, contract_dim, watch=operands)

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


class CastRequest(NamedTuple):
    """One cast for ``cast_operands``: the quantizer that makes it, its input, its settings
    (whose ``rule`` and ``row`` are the quantizer's) and the input's stored scales where
    ``spec.stored_as`` says the input is stored data (see ``Quantizer.request``)."""

    quantizer: Quantizer
    x: torch.Tensor
    spec: CastSpec
    stored_scale: torch.Tensor | None = None


def cast_operands(requests: tuple[CastRequest, ...]) -> tuple[OperandCast, ...]:
    """The casts of ``requests`` (as ``Quantizer.cast_layouts`` makes each), in order. The
    casts with scales run together: one call of compiled kernels where their quantizers
    are compiled (``amp8.nn.cast_kernels.run_casts``). Their quantizers share one layer's
    buffers (``scales``, ``histories``, ``health``); microscaled casts run one by one.

    Raises:
        ValueError: a request records or watches into buffers its quantizer has not, or
            the requests' quantizers belong to different layers.
    """
    for request in requests:
        request.quantizer._check_request(request)
    scaled = [i for i, request in enumerate(requests) if not request.quantizer.rule.microscaled]
    casts: dict[int, OperandCast] = {}
    if scaled:
        first = requests[scaled[0]].quantizer
        if not all(_same_buffers(requests[i].quantizer, first) for i in scaled):
            raise ValueError("cast_operands casts one layer's operands: these quantizers hold different buffers")
        outs = run_casts(tuple(requests[i].spec for i in scaled), tuple(requests[i].x for i in scaled),
                         first.scales, first.histories, first.health, first.compiled,
                         tuple(requests[i].stored_scale for i in scaled))
        for i, out in zip(scaled, outs):
            block_size = requests[i].quantizer.rule.scale_block_size
            casts[i] = OperandCast(
                None if out.rows is None else ScaledTensor(out.rows, out.scale, block_size, out.inverse),
                None if out.columns is None else ScaledTensor(out.columns, out.scale, block_size, out.inverse),
            )
    return tuple(casts[i] if i in casts else request.quantizer._microscaled_layouts(request)
                 for i, request in enumerate(requests))


def _same_buffers(quantizer: Quantizer, other: Quantizer) -> bool:
    """Whether two quantizers write the same layer's buffers and run alike compiled."""
    return (quantizer.scales is other.scales and quantizer.histories is other.histories
            and quantizer.health is other.health and quantizer.compiled == other.compiled)


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
        compiled: bool = False,
    ) -> "LinearQuantizers":
        """Quantizers for ``recipe`` over a layer's ``scale`` (roles,), ``amax_history``
        (roles, L) and ``health`` buffers. The input's and output gradient's wgrad casts
        are rotated by ``rotation`` where one is given (``Recipe.wgrad_hadamard``); casts
        run compiled as ``compiled`` says (see ``Quantizer.compiled``)."""
        recorded = [
            Quantizer(CastRule.for_role(recipe, role), scales, histories, role.value, health=health,
                      rotation=None if role is TensorRole.WEIGHT else rotation, compiled=compiled)
            for role in TensorRole
        ]
        return cls(*recorded)

    def of(self, role: TensorRole) -> Quantizer:
        """The quantizer of the tensor in ``role``."""
        return self[role.value]  # an IntEnum index is not traced by torch.compile
