"""The per-tensor precision report: what each parameter really stores, read off the tensors.

Nothing here consults the precision table. Dtypes come from the tensors the model and
optimizer hold; bytes from their sizes; underflow and saturation from casting the real
weight with the scale its layer would use.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from amp8.config.controller import Move
from amp8.config.formats import short_name
from amp8.config.levels import Precision
from amp8.config.recipe import OutputHead
from amp8.config.validation import check_model_and_optimizer
from amp8.monitor.console import default_console
from amp8.monitor.operand_health import operand_health
from amp8.monitor.report_fold import fold_rows
from amp8.monitor.report_plot import plot_report
from amp8.monitor.report_row import FROZEN, ReportRow
from amp8.monitor.report_table import human_bytes, print_table
from amp8.monitor.report_view import print_folded, print_operands
from amp8.monitor.weight_stats import NO_CAST, weight_cast_stats
from amp8.nn.adapters import adapted_embeddings
from amp8.nn.experts import Fp8Experts
from amp8.nn.gemm_layers import gemm_kind
from amp8.nn.linear import Fp8Linear
from amp8.nn.selection import resolve_selection
from amp8.nn.swap import ModelFacts, embedding_reason, gemm_layer_reason
from amp8.tensor.stored import stored_weight

FP32_ADAM_BYTES_PER_PARAM = 16
"""FP32 weight + FP32 gradient + FP32 first and second moments."""


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.nbytes


def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str | None]]:
    """``id(param) -> (owning module, note)``; the note says why a parameter that could
    look like an FP8 candidate stays in high precision: every GEMM layer amp8 did not
    swap (``nn.Linear``, its subclasses, ``Conv1D``-like layers) gets one.

    The reasons are found again as the swap found them (``gemm_layer_reason``), with the
    recipes the FP8 layers hold (the default recipe's where there is none: the output
    head kept) and the default speed rule of each layer's device; what only the call
    knew (``module_filter``, another ``layer_selection``) is the last note."""
    fp8 = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    kept_by_recipe = tuple(dict.fromkeys(  # the recipes' patterns, in order, once each
        pattern for module in fp8 for pattern in module.recipe.high_precision_layers
    ))
    keeps_heads = not fp8 or any(m.recipe.output_head is OutputHead.HIGH for m in fp8)
    facts = ModelFacts.of(model, keeps_heads)
    adapted = adapted_embeddings(model)
    owners: dict[int, tuple[nn.Module, str | None]] = {}
    for fqn, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            note = None
            if gemm_kind(module) is not None and param_name == "weight":
                rule = resolve_selection("auto", param.device.type)
                note = gemm_layer_reason(module, fqn, facts, rule, None, kept_by_recipe) or (
                    "not selected for FP8 (module_filter or layer_selection)" if fp8 else _NO_FP8_NOTE
                )
            elif isinstance(module, _CONVOLUTIONS) and param_name == "weight":
                note = _CONVOLUTION_NOTE
            elif type(module) is nn.Embedding and param_name == "weight":
                note = embedding_reason(module, facts.shared) or adapted.get(id(module))
            elif isinstance(module, Fp8Experts):
                note = _EXPERTS_NOTE if module.weight_storage is not Precision.AS_IS else _EXPERTS_AS_IS_NOTE
            owner = owners.setdefault(id(param), (module, note))
            if note and owner[1] is None:
                # A tied weight: the row belongs to its first owner (the embedding), but
                # the note says why the Linear that shares it stays in high precision.
                owners[id(param)] = (owner[0], note)
    return owners


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONVOLUTION_NOTE = "a convolution: amp8 runs linear layers in FP8, convolutions as the model has them"
_NO_FP8_NOTE = "no FP8 layer in the model: O0, or every layer refused by module_filter or layer_selection"
_EXPERTS_NOTE = "MoE experts: GEMMs in FP8, stored as FP8 layers' weights with scales per expert"
_EXPERTS_AS_IS_NOTE = "MoE experts: GEMMs in FP8; weight and gradient as the model keeps them"
_LOW_BIT_TABLE_NOTE = "FP16 table (one scale), FP8 gradient (one scale per row): a lookup, not a GEMM"


@dataclass
class PrecisionReport:
    """One row per parameter, with what is really stored for it (a ``ReportRow`` each:
    ``amp8.monitor.report_row``; ``to_dict`` gives them as plain data).

    ``activation_bytes_per_token``: bytes autograd saved for backward per token in one
    measured step (``amp8.count_saved_bytes``), when the caller measured it.
    """

    rows: list[ReportRow]
    skipped_steps: int | None = None
    baseline_bytes_per_param: int = field(default=FP32_ADAM_BYTES_PER_PARAM)
    activation_bytes_per_token: float | None = None

    @staticmethod
    def _per_param(rows: list[ReportRow]) -> float:
        numel = sum(row.numel for row in rows)
        return sum(row.bytes for row in rows) / numel if numel else 0.0

    @property
    def bytes_per_param(self) -> float:
        """Persistent bytes (weights, gradients, optimizer state) per parameter."""
        return self._per_param(self.rows)

    @property
    def fp8_bytes_per_param(self) -> float:
        """The same, over the weights of FP8 layers only (0 when there are none)."""
        return self._per_param([row for row in self.rows if row.fp8])

    def frozen_bytes_per_param(self, fp8_layers_only: bool = False) -> float:
        """The same, over frozen parameters only (0 when there are none): the bytes a
        frozen base costs in fine-tuning; with ``fp8_layers_only``, over the frozen
        weights of FP8 layers."""
        return self._per_param([row for row in self.rows if row.frozen and (row.fp8 or not fp8_layers_only)])

    @property
    def fp8_share(self) -> float:
        """Fraction of all parameters that are weights of FP8 layers or FP8 experts."""
        total = sum(row.numel for row in self.rows)
        fp8 = sum(row.numel for row in self.rows if row.fp8)
        return fp8 / total if total else 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrecisionReport":
        """The report ``to_dict()`` (or ``json.loads(to_json())``) produced, rebuilt.

        Raises:
            ValueError: ``data`` is not a mapping with a list of ``rows``, or a row is not
                one (``ReportRow.from_dict``).
        """
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(
                f"PrecisionReport.from_dict needs a dict with a list of 'rows' (what to_dict() "
                f"returns), got {type(data).__name__}"
            )
        return cls(
            rows=[ReportRow.from_dict(row) for row in data["rows"]],
            skipped_steps=data.get("skipped_steps"),
            baseline_bytes_per_param=data.get("baseline_bytes_per_param", FP32_ADAM_BYTES_PER_PARAM),
            activation_bytes_per_token=data.get("activation_bytes_per_token"),
        )

    def highlights(self, top: int = 3) -> list[str]:
        """A few lines to read at a glance: FP8 share and what stays in high precision,
        underflow and saturation hot spots, the ``top`` tensors by bytes.

        Raises:
            ValueError: ``top`` is not an int >= 1.
        """
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(f"highlights(top={top!r}) is not valid; use an int >= 1")
        rows = self.rows
        fp8_rows = [row for row in rows if row.fp8]
        tables = [row.name for row in rows if row.note == _LOW_BIT_TABLE_NOTE]
        kept = [row for row in rows if row.note and row.note != _LOW_BIT_TABLE_NOTE and row.layer != "Fp8Experts"]
        shown = ", ".join(f"{row.name} ({row.note})" for row in kept[:top])
        shown += f" and {len(kept) - top} more" if len(kept) > top else ""
        line = f"FP8: {100 * self.fp8_share:.1f}% of parameters in {len(fp8_rows)} FP8 layers"
        if not fp8_rows and kept:
            line = f"FP8: none; {len(kept)} kept in high precision: {shown}"
        elif not fp8_rows:
            line = "FP8: none (no GEMM layers found)"
        elif kept:
            line += f"; high precision: {shown}"
        if tables:
            line += f"; FP16 tables with FP8 gradients: {', '.join(tables)}"
        lines = [line]
        for label, share in (("underflow", attrgetter("underflow")), ("saturation", attrgetter("saturated"))):
            hot = sorted((row for row in fp8_rows if share(row)), key=lambda row: -share(row))[:top]
            if hot:
                lines.append(f"{label} hot spots: " + ", ".join(f"{row.name} {100 * share(row):.2g}%" for row in hot))
            elif fp8_rows:
                lines.append(f"{label}: none")
        moved = [row for row in fp8_rows if row.moves]
        if moved:
            lines.append("GEMMs moved: " + ", ".join(f"{row.name} ({row.gemms})" for row in moved[:top])
                         + (f" and {len(moved) - top} more" if len(moved) > top else ""))
        total = sum(row.bytes for row in rows)
        biggest = sorted(rows, key=lambda row: -row.bytes)[:top]
        if total:
            lines.append(
                "largest: "
                + ", ".join(f"{row.name} {human_bytes(row.bytes)} ({100 * row.bytes / total:.0f}%)" for row in biggest)
            )
        return lines

    def moves(self) -> list[dict[str, Any]]:
        """Every move ``amp8.Controller`` made, over all layers, by step (each a dict:
        step, layer, before, after, reason)."""
        return [dataclasses.asdict(move) for move in self._moves()]

    def _moves(self) -> list[Move]:
        """The moves of ``moves()``, as ``Move``s."""
        return sorted((move for row in self.rows for move in row.moves or ()), key=lambda move: move.step)

    def to_dict(self) -> dict[str, Any]:
        """Rows and totals as plain Python data."""
        return {
            "rows": [row.to_dict() for row in self.rows],
            "bytes_per_param": self.bytes_per_param,
            "fp8_bytes_per_param": self.fp8_bytes_per_param,
            "frozen_bytes_per_param": self.frozen_bytes_per_param(),
            "fp8_share": self.fp8_share,
            "baseline_bytes_per_param": self.baseline_bytes_per_param,
            "skipped_steps": self.skipped_steps,
            "activation_bytes_per_token": self.activation_bytes_per_token,
        }

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    def print(self, console: Any = None, full: bool = False) -> None:
        """Print the report: the summary, then one row per role with repeated blocks
        folded (``model.layers.{0..31}.mlp.down_proj.weight``, the spread over blocks),
        then what needs attention (``amp8.monitor.report_view``). With ``full``, or
        where no three blocks repeat, one row per tensor, with notes and totals below."""
        console = console or default_console()
        folded = fold_rows(self.rows)
        if full or len(folded) == len(self.rows):  # nothing to fold: every row as it is
            print_table(self.rows, self._moves(), self.summary(), self.highlights(), console)
            print_operands(self.rows, console, fold=False)
        else:
            print_folded(folded, self._moves(), self.summary(), console, _LOW_BIT_TABLE_NOTE)
            print_operands(self.rows, console)

    def plot(self, path: str | Path, by: str | None = None) -> Path:
        """Save the report as a heatmap PNG at ``path``: GEMM layers by block and role,
        coloured by their casts' worst SQNR (``by="sqnr"``, where operands were watched
        with ``amp8.watch_operands``) or by the largest share flushed or clipped
        (``by="health"``); layers kept in high precision and moved by the controller are
        marked (``amp8.monitor.report_plot``). Returns the path.

        Raises:
            ModuleNotFoundError: when matplotlib is not installed, saying how to get it.
            ValueError: an unknown ``by``, or "sqnr" without watched operands.
        """
        return plot_report(self.rows, path, by)

    def summary(self) -> str:
        """One line: parameters, FP8 share, bytes/param against the FP32-Adam baseline."""
        baseline, total = self.baseline_bytes_per_param, self.bytes_per_param
        numel = sum(row.numel for row in self.rows)
        text = f"{numel:,} parameters, {100 * self.fp8_share:.1f}% in FP8 layers; {total:.2f} bytes/param"
        if self.fp8_share:
            text += f" ({self.fp8_bytes_per_param:.2f} over FP8 layers)"
        if total:
            text += f" vs {baseline} for FP32 Adam ({baseline / total:.2f}x less)"
        frozen = sum(row.numel for row in self.rows if row.frozen)
        if frozen:
            text += f"; {frozen:,} frozen at {self.frozen_bytes_per_param():.2f} bytes/param"
        if self.activation_bytes_per_token is not None:
            text += f"; {self.activation_bytes_per_token:,.0f} activation bytes/token saved for backward"
        if self.skipped_steps is not None:
            text += f"; skipped (overflow) steps: {self.skipped_steps}"
        return text + "."


def _stored_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype ``param`` is stored in: an FP8 layer's storage (its Parameter reports the
    model's dtype), else its own."""
    handle = stored_weight(param)
    return param.dtype if handle is None else handle.data.dtype


def report(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    activation_bytes_per_token: float | None = None,
) -> PrecisionReport:
    """The precision report of ``model`` (and ``optimizer``'s state, when given), with
    ``activation_bytes_per_token`` (measured with ``amp8.count_saved_bytes``) beside the
    bytes per parameter when given.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
    """
    check_model_and_optimizer("amp8.report", model, optimizer)
    owners = _owners(model)
    state = optimizer.state if optimizer is not None else {}
    rows = []
    for name, param in model.named_parameters():
        module, note = owners[id(param)]
        fp8_layer = module if isinstance(module, Fp8Linear) and param is module.weight else None
        if fp8_layer is not None and fp8_layer.weight_storage is Precision.AS_IS:
            note = note or "FP8 compute only: weight and gradient as the model keeps them"
            grad_dtype = None if param.grad is None else param.grad.dtype
            grad_bytes, weight_bytes = _nbytes(param.grad), param.nbytes
            stats = weight_cast_stats(fp8_layer, fp8_layer.read_weight())
        elif (handle := stored_weight(param)) is not None:  # an FP8 layer's weight, or a low-bit table
            grad = handle.grad()
            grad_dtype = None if grad is None else grad.dtype
            grad_bytes = 0 if grad is None else grad.nbytes  # FP8 data + scales, while there is one
            weight_bytes = handle.nbytes
            stats = NO_CAST
            if fp8_layer is not None:
                has_master = "master" in state.get(param, {})  # a frozen weight has none
                real = optimizer.master_weight(param) if has_master else fp8_layer.read_weight()  # type: ignore[union-attr]
                stats = weight_cast_stats(fp8_layer, real)
            else:
                note = note or _LOW_BIT_TABLE_NOTE
        else:
            grad_dtype = None if param.grad is None else param.grad.dtype
            grad_bytes = _nbytes(param.grad)
            weight_bytes = param.nbytes
            stats = NO_CAST
        param_state = state.get(param, {})
        state_bytes = sum(_nbytes(v) for v in param_state.values() if torch.is_tensor(v))

        def state_dtype(key: str) -> str | None:
            value = param_state.get(key)
            return short_name(value.dtype) if torch.is_tensor(value) else None

        rows.append(ReportRow(
            name=name,
            shape=tuple(param.shape),
            numel=param.numel(),
            layer=type(module).__name__,
            fp8=fp8_layer is not None or isinstance(module, Fp8Experts),
            note=note,
            weight=short_name(_stored_dtype(param)),
            grad=FROZEN if not param.requires_grad else short_name(grad_dtype),
            frozen=not param.requires_grad,
            master=state_dtype("master"),
            exp_avg=state_dtype("exp_avg"),
            exp_avg_sq=state_dtype("exp_avg_sq"),
            **stats.cast_fields(),
            operands=None if fp8_layer is None else operand_health(fp8_layer),
            bytes=weight_bytes + grad_bytes + state_bytes,
        ))
    skipped = getattr(optimizer, "skipped_steps", None)
    return PrecisionReport(rows=rows, skipped_steps=skipped, activation_bytes_per_token=activation_bytes_per_token)
