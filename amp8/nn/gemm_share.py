"""How much of a model's GEMM work an opt level runs in FP8, estimated at ``initialize``,
and the warning when FP8 compute is absent or a minority.

The estimate weighs each GEMM layer by its weight's element count: a linear layer with a
(N, K) weight does 2 * K * N FLOPs per token in each of its three GEMMs, so its share of
the per-token GEMM FLOPs is its share of the GEMM weights' elements (an experts module
counts all its experts, an upper bound on the work its routed tokens do).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from amp8.nn.experts import Fp8Experts
from amp8.nn.linear import Fp8Linear

HIGH_PRECISION_SHARE_LIMIT = 0.5
"""``initialize`` warns when more than this share of the GEMM work stays in high precision."""

SHOWN_LAYERS = 3
"""Kept layers the warning names, the largest first."""


@dataclass(frozen=True)
class GemmShare:
    """The GEMM weights' elements that run in FP8, and those of each layer kept high.

    Attributes:
        fp8_elements: elements of the weights of the FP8 layers and experts.
        kept: ``(fqn, class name, elements, reason)`` of each GEMM layer kept in high
            precision, the largest first.
    """

    fp8_elements: int
    kept: tuple[tuple[str, str, int, str], ...]

    @classmethod
    def of(cls, model: nn.Module, kept: dict[str, str]) -> "GemmShare":
        """The share in ``model`` after the swap, with ``kept`` the swap's
        ``{fqn: reason}`` of the GEMM layers and experts it left in high precision."""
        fp8 = 0
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                fp8 += module.weight.numel()
            elif isinstance(module, Fp8Experts):
                fp8 += sum(handle.param.numel() for handle in module.stored_weights())
        rows = []
        for fqn, reason in kept.items():
            module = model.get_submodule(fqn)
            weight = getattr(module, "weight", None)
            elements = weight.numel() if weight is not None else sum(p.numel() for p in module.parameters())
            rows.append((fqn, type(module).__name__, elements, reason))
        return cls(fp8, tuple(sorted(rows, key=lambda row: -row[2])))

    @property
    def total_elements(self) -> int:
        """Elements of every GEMM weight, FP8 or kept."""
        return self.fp8_elements + sum(row[2] for row in self.kept)

    @property
    def high_precision_share(self) -> float:
        """The estimated share of the GEMM FLOPs per token kept in high precision (0 with no GEMM layer)."""
        total = self.total_elements
        return (total - self.fp8_elements) / total if total else 0.0

    def warning(self, level_name: str) -> str | None:
        """The warning of ``initialize`` at the opt level named ``level_name``, or None
        where FP8 runs more than ``1 - HIGH_PRECISION_SHARE_LIMIT`` of the GEMM work."""
        if self.fp8_elements and self.high_precision_share <= HIGH_PRECISION_SHARE_LIMIT:
            return None
        if not self.kept:
            return (
                f"amp8: opt level {level_name} found no GEMM layer to run in FP8 (nn.Linear, a subclass with "
                "Linear's math, a Conv1D-like layer, a MoE experts module): FP8 compute is absent; the "
                "optimizer and weight storage still follow the level. Build the model's projections from "
                "nn.Linear for FP8 GEMMs"
            )
        shown = "; ".join(
            f"{fqn} ({name}, {100 * elements / self.total_elements:.0f}%): {reason}"
            for fqn, name, elements, reason in self.kept[:SHOWN_LAYERS]
        )
        more = f"; and {len(self.kept) - SHOWN_LAYERS} more" if len(self.kept) > SHOWN_LAYERS else ""
        if not self.fp8_elements:
            head = (
                f"amp8: opt level {level_name} runs no layer in FP8: FP8 compute is absent (the optimizer and "
                f"weight storage still follow the level); {len(self.kept)} GEMM layers stay in high precision"
            )
        else:
            head = (
                f"amp8: opt level {level_name} leaves about {100 * self.high_precision_share:.0f}% of the GEMM "
                f"FLOPs per token (estimated by weight elements) in high precision"
            )
        return (
            f"{head}, the largest: {shown}{more}. amp8.report(model) lists every such layer with its reason; "
            "what can be changed (module_filter, layer_selection='all', Recipe(output_head='fp8'), "
            "high_precision_layers) is named in the reason, and shapes need multiples of 16"
        )
