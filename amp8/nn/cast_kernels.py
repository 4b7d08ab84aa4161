"""One FP8 cast of a GEMM operand as one function, run as compiled kernels in eager code.

``scaled_cast`` does all of a (not microscaled) cast: the amax, the scale, the record of
both in the layer's buffers, the FP8 data in the layouts the GEMMs read (the operand's
own, and the transposed copy for the other GEMM, written in the same pass), its health
signals, and, for a weight, the decoding of its stored form (``CastSpec.stored_as``), so
that no float32 copy of the weight goes through memory. Inside the user's
``torch.compile`` it is traced like any other code; outside it, ``run_casts`` runs it
compiled (``torch.compile``, full graph, dynamic shapes), so a model the user does not
compile still gets its casts as a few fused kernels instead of a dozen eager operations
each; the casts of a layer that happen at one time (``scaled_casts``) run in one call,
which costs the host as much as one cast's. One compiled function per tuple of
``CastSpec`` (the static settings) serves every layer and shape, from a bounded cache
(``amp8._compiled.compiled_for``); without a compiler for the device the casts run
eagerly, with the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from amp8._compiled import call_compiled
from amp8.config.recipe import Granularity, Scaling
from amp8.nn.cast_rule import CastRule
from amp8.quant import scaling
from amp8.quant.codec import Layout
from amp8.quant.health import GemmOperand, cast_health, record_health
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, pad_rows

@dataclass(frozen=True)
class CastSpec:
    """The static settings of one cast: all but its tensors, so one compiled function
    per spec serves every layer and shape. ``scaled_cast`` makes the casts with scales;
    a microscaled one has its own path (``amp8.nn.quantizer.Quantizer``).

    Attributes:
        rule: the role's ``CastRule``.
        row: the role's row in the layer's ``scale`` and ``amax_history`` buffers.
        contract_dim: the dim of the 2-D input the GEMM contracts.
        record: the scale (the smallest, for finer granularities) goes to the role's row
            of ``scale``; with ``update_history`` too, the amax to its history.
        update_history: see ``record``.
        watch: the health rows the cast's signals go to (``amp8.quant.health``).
        rows: give the FP8 data in the input's own layout (row-major).
        columns: give the FP8 data column-major: the transposed operand of the
            weight-gradient GEMM, written in the same pass. With ``rows``, one scale per
            tensor serves both layouts.
        padded: the column-major copy has zero rows appended to a multiple of
            ``GEMM_ALIGNMENT``, as the GEMM takes it. Without ``rows`` the cast scales
            (and watches) the padded input, whose zero rows change no amax.
        stored_as: the storage codec of the input, which is then stored data (its
            scales passed beside it) that the cast decodes first, in the same call;
            None for real values.
        transposed: the input's real values are transposed before the cast (a
            Parameter that holds ``W^T``).
        replay: the cast repeats one made before (a forward that activation
            checkpointing runs again in backward): under delayed scaling it takes the
            scale the first cast recorded, not the history that cast has since
            advanced, so its FP8 data is the first cast's; it records nothing, whatever
            ``record`` says (``records``).
    """

    rule: CastRule
    row: int
    contract_dim: int = 1
    record: bool = False
    update_history: bool = False
    watch: tuple[GemmOperand, ...] = ()
    rows: bool = True
    columns: bool = False
    padded: bool = False
    stored_as: Layout | None = None
    transposed: bool = False
    replay: bool = False

    def __post_init__(self) -> None:
        check_layouts(self.rows, self.columns, self.padded, self.rule.granularity is Granularity.TENSORWISE)

    @property
    def records(self) -> bool:
        """Whether the cast records its scale (and amax): asked to, and not a replay."""
        return self.record and not self.replay


def check_layouts(rows: bool, columns: bool, padded: bool, one_scale: bool) -> None:
    """Raise ``ValueError`` unless one cast can give these layouts (see ``CastSpec``):
    rows and columns together only with ``one_scale`` per tensor."""
    if not (rows or columns):
        raise ValueError("a cast that gives no data: ask for rows, columns or both")
    if padded and not columns:
        raise ValueError("a cast pads its column-major copy only: ask for columns too")
    if rows and columns and not one_scale:
        raise ValueError(
            "one cast serves both layouts only with one scale per tensor; cast the padded "
            "columns separately for finer granularities"
        )


class CastOutputs(NamedTuple):
    """What ``scaled_cast`` gives: the FP8 data in each layout asked for (else None), the
    scales (see ``Quantizer.next_scale``) and their reciprocals (what a GEMM is handed)."""

    rows: torch.Tensor | None
    columns: torch.Tensor | None
    scale: torch.Tensor
    inverse: torch.Tensor


def unit_scale(rule: CastRule, amaxes: torch.Tensor, previous: torch.Tensor | None,
               history: torch.Tensor | None) -> torch.Tensor:
    """Scaling.NONE: every scale is 1."""
    return torch.ones_like(amaxes)


def current_scale(rule: CastRule, amaxes: torch.Tensor, previous: torch.Tensor | None,
                  history: torch.Tensor | None) -> torch.Tensor:
    """Scaling.CURRENT: the scales of the tensor's own amaxes."""
    return rule.scale_from_amax(amaxes, previous)


def delayed_scale(rule: CastRule, amaxes: torch.Tensor, previous: torch.Tensor | None,
                  history: torch.Tensor | None) -> torch.Tensor:
    """Scaling.DELAYED: the scale of the amax history's reduction, or of the tensor's own
    amaxes while the history is still empty."""
    fresh = current_scale(rule, amaxes, previous, history)
    delayed = rule.scale_from_amax(scaling.history_amax(history, rule.amax_algo), previous)  # type: ignore[arg-type]
    return torch.where(history.amax() > 0, delayed, fresh)  # type: ignore[union-attr]


ScaleRule = Callable[[CastRule, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]
SCALE_RULES: dict[Scaling, ScaleRule] = {
    Scaling.NONE: unit_scale,
    Scaling.CURRENT: current_scale,
    Scaling.DELAYED: delayed_scale,
}
"""How each scaling kind picks a scale from a tensor's tile amaxes, the previous scale
and the amax history."""


def tile_scales(
    rule: CastRule, x: torch.Tensor, contract_dim: int, scales: torch.Tensor | None,
    histories: torch.Tensor | None, row: int, replay: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, amax)`` of a cast of the 2-D ``x`` under ``rule`` (see
    ``Quantizer.next_scale``), reading the role's ``row`` of the layer's buffers; with
    ``replay`` (see ``CastSpec.replay``), delayed scaling's scale is the recorded one."""
    tile = rule.tile(tuple(x.shape), contract_dim)
    amaxes = scaling.tile_amax(x, tile)
    previous = scales[row] if tile is None and scales is not None else None
    if replay and rule.scaling is Scaling.DELAYED and previous is not None:
        return previous.clone(), amaxes.amax()
    history = histories[row] if histories is not None else None
    return SCALE_RULES[rule.scaling](rule, amaxes, previous, history), amaxes.amax()


def record_scale(
    scales: torch.Tensor, histories: torch.Tensor, row: int, scale: torch.Tensor, current_amax: torch.Tensor,
    update_history: bool,
) -> None:
    """Write a cast's scale (the smallest of ``scale``) to ``row`` of ``scales`` and, with
    ``update_history``, its amax (0 where not finite) to that row of ``histories``."""
    with torch.no_grad():
        scales[row] = scale.amin()
        if update_history:
            finite_amax = torch.where(torch.isfinite(current_amax), current_amax, 0.0)
            histories[row] = scaling.push_history(histories[row], finite_amax)


def decoded(stored_as: Layout | None, transposed: bool, data: torch.Tensor,
            scale: torch.Tensor | None) -> torch.Tensor:
    """The real values of stored ``data`` with its ``scale`` under the codec ``stored_as``
    (float32; ``data`` itself without a codec), transposed where ``transposed``."""
    real = data if stored_as is None else stored_as.decode(data, scale)
    return real.t().contiguous() if transposed else real


def scaled_cast(
    spec: CastSpec, x: torch.Tensor, scales: torch.Tensor | None, histories: torch.Tensor | None,
    health: torch.Tensor | None, stored_scale: torch.Tensor | None = None,
) -> CastOutputs:
    """The cast of the 2-D ``x`` that ``spec`` describes (see ``CastSpec``), writing the
    layer's ``scales``, ``histories`` and ``health`` buffers in place as it says;
    ``stored_scale``: the scales of ``x``'s stored data under ``spec.stored_as``.

    Raises:
        ValueError: a microscaled cast, which has its own path.
    """
    if spec.rule.microscaled:
        raise ValueError("scaled_cast makes FP8 casts with scales; microscaled casts have their own path")
    x = decoded(spec.stored_as, spec.transposed, x, stored_scale)
    # A padded cast pads before the cast where it scales the padded tensor (columns only)
    # and where it is compiled: there the zero rows cost no pass, and one loop writes both
    # layouts (rows and columns share one scale per tensor, which the zero rows do not
    # change). Eagerly it pads the FP8 bytes after the cast, not the wider input.
    pad_first = spec.padded and (not spec.rows or torch.compiler.is_compiling())
    source = pad_rows(x, GEMM_ALIGNMENT) if pad_first else x
    scaled = x if spec.rows else source  # what the scale is taken from and the health watches
    scale, current_amax = tile_scales(spec.rule, scaled, spec.contract_dim, scales, histories, spec.row, spec.replay)
    if spec.records and x.numel() > 0:  # an empty batch says nothing about the range
        record_scale(scales, histories, spec.row, scale, current_amax, spec.update_history)  # type: ignore[arg-type]
    data = scaling.quantize(source, scaling.expand_scale(scale, tuple(source.shape), spec.rule.scale_block_size),
                            spec.rule.dtype)
    # The unpadded head; the data itself where nothing was padded (a view would be one more
    # tensor for the compiled call to make and the layer's cache to free, every step).
    rows = (data if source is x else data[: x.shape[0]]) if spec.rows else None
    if spec.watch:
        full_scale = scaling.expand_scale(scale, tuple(scaled.shape), spec.rule.scale_block_size)
        record_health(health, spec.watch, cast_health(scaled, full_scale, data if rows is None else rows))  # type: ignore[arg-type]
    columns = None
    if spec.columns:
        columns = column_major(data if pad_first or not spec.padded else pad_rows(data, GEMM_ALIGNMENT))
    return CastOutputs(rows, columns, scale, scale.reciprocal())


def scaled_casts(
    specs: tuple[CastSpec, ...], inputs: tuple[torch.Tensor, ...], scales: torch.Tensor | None,
    histories: torch.Tensor | None, health: torch.Tensor | None,
    stored_scales: tuple[torch.Tensor | None, ...],
) -> tuple[CastOutputs, ...]:
    """``scaled_cast`` of each of ``inputs`` under its spec (and stored scale), in order:
    the casts of one layer (one ``scales``, ``histories`` and ``health``) that a forward
    or a backward makes together."""
    return tuple(scaled_cast(spec, x, scales, histories, health, stored_scale)
                 for spec, x, stored_scale in zip(specs, inputs, stored_scales, strict=True))


def run_casts(
    specs: tuple[CastSpec, ...], inputs: tuple[torch.Tensor, ...], scales: torch.Tensor | None,
    histories: torch.Tensor | None, health: torch.Tensor | None, compiled: bool,
    stored_scales: tuple[torch.Tensor | None, ...],
) -> tuple[CastOutputs, ...]:
    """``scaled_casts(specs, ...)``, as one call of compiled kernels where
    ``amp8._compiled.runs_compiled(inputs, compiled)``: each compiled call costs the host
    tens of microseconds, whatever it casts."""
    return call_compiled(scaled_casts, specs, inputs, scales, histories, health, stored_scales, compiled=compiled)


def run_cast(
    spec: CastSpec, x: torch.Tensor, scales: torch.Tensor | None, histories: torch.Tensor | None,
    health: torch.Tensor | None, compiled: bool = False, stored_scale: torch.Tensor | None = None,
) -> CastOutputs:
    """``scaled_cast(spec, ...)``, as compiled kernels where
    ``amp8._compiled.runs_compiled(x, compiled)``."""
    return run_casts((spec,), (x,), scales, histories, health, compiled, (stored_scale,))[0]
