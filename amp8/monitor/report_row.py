"""One row of the precision report (``amp8.report``): what is really stored for one
parameter and, for the weights of FP8 layers, what their FP8 cast does to them.

A row is a frozen ``ReportRow``; ``to_dict`` gives it as the plain data of the report's
JSON (``PrecisionReport.to_dict``) and ``from_dict`` reads it back, also from reports
written before a field existed (it takes its default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from amp8.config.controller import Move

FROZEN = "frozen"
"""The grad field of a parameter with ``requires_grad=False``."""


@dataclass(frozen=True)
class WeightCastStats:
    """What the FP8 cast of one layer's weight does to it and how the layer's GEMMs run
    (``amp8.monitor.weight_stats.weight_cast_stats``): the fields of that name of a
    ``ReportRow``; all None for a parameter that is no FP8 layer's weight."""

    granularity: str | None = None
    gemms: str | None = None
    moves: tuple[Move, ...] | None = None
    scale: float | None = None
    scale_min: float | None = None
    scale_max: float | None = None
    amax: float | None = None
    underflow: float | None = None
    saturated: float | None = None
    format: str | None = None
    block: str | None = None

    def cast_fields(self) -> dict[str, Any]:
        """The stats by field name (the moves as they are), to build a report row from."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(WeightCastStats)}


_CAST_FIELDS = tuple(field.name for field in dataclasses.fields(WeightCastStats))


@dataclass(frozen=True, kw_only=True)
class ReportRow(WeightCastStats):
    """What is really stored for one parameter, read off the tensors.

    Attributes:
        name: the parameter's name in the model.
        shape: its shape.
        numel: its number of elements.
        layer: the owning module's class name.
        fp8: True for the weights of FP8 layers and of ``Fp8Experts``, whose GEMMs run in
            FP8.
        note: why a GEMM layer's weight stays in high precision (or what a low-bit table
            is), else None.
        weight, grad, master, exp_avg, exp_avg_sq: torch dtype names of what is stored,
            or None; grad is "frozen" (``FROZEN``) for a parameter with
            ``requires_grad=False``.
        frozen: True for those: they hold no gradient and no optimizer state.
        granularity: the recipe's granularity (FP8 layers' weights only, as the fields
            below; None elsewhere).
        gemms: how the layer's GEMMs run now, e.g. "block, wgrad high", after
            ``amp8.Controller`` moved it.
        moves: the controller's moves of the layer.
        scale: the weight's scale (None when it has several).
        scale_min, scale_max: the range of the weight's FP8 scales.
        amax, underflow, saturated: the weight's absolute max and the shares of its values
            its FP8 cast flushes to zero and clips (over this rank's rows of a weight
            sharded over data-parallel ranks).
        format, block: microscaled layers' forward-GEMM weight operand as elements/block
            scales, e.g. "nvfp4 e2m1/e4m3", and its block, e.g. "16x16"; else None.
        operands: the health of the layer's GEMM operands' casts where they were
            watched (``amp8.monitor.operand_health``), by operand label.
        bytes: what this process stores for the parameter: weight + gradient + optimizer
            state, scales included; a sharded weight counts its own rows.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    layer: str
    fp8: bool
    note: str | None
    weight: str
    grad: str | None
    frozen: bool = False
    master: str | None = None
    exp_avg: str | None = None
    exp_avg_sq: str | None = None
    operands: dict[str, dict[str, float]] | None = None
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        """The row as plain data (lists for the shape and the moves, each move a dict:
        step, layer, before, after, reason)."""
        own = [field.name for field in dataclasses.fields(self) if field.name not in _CAST_FIELDS]
        at = own.index("operands")  # the cast's fields sit before the operands' health
        data = {name: getattr(self, name) for name in own[:at] + list(_CAST_FIELDS) + own[at:]}
        data["shape"] = list(self.shape)
        data["moves"] = None if self.moves is None else [dataclasses.asdict(move) for move in self.moves]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReportRow":
        """The row ``to_dict`` gave; a field it lacks (a report written before the field
        existed) takes its default, and keys that are no field are left out.

        Raises:
            ValueError: ``data`` is not a mapping, or lacks a field that has no default.
        """
        if not isinstance(data, dict):
            raise ValueError(
                f"a precision report row is a dict (what ReportRow.to_dict() returns), got {type(data).__name__}"
            )
        fields = dataclasses.fields(cls)
        missing = [field.name for field in fields if field.default is dataclasses.MISSING and field.name not in data]
        if missing:
            raise ValueError(
                f"a precision report row needs {', '.join(missing)} (ReportRow.to_dict() writes every field); "
                f"got only {', '.join(data) or 'no key'}"
            )
        values = {field.name: data[field.name] for field in fields if field.name in data}
        values["shape"] = tuple(values["shape"])
        if values.get("moves") is not None:
            values["moves"] = tuple(Move(**move) for move in values["moves"])
        return cls(**values)
