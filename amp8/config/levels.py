"""The precision table, as data: one frozen ``OptLevel`` per opt level.

This is the contract users pick from. Code reads its columns (never the level's name)
to decide what to build; the precision report reads the real tensors instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping


class Precision(str, Enum):
    """How one column of the table is stored or computed."""

    AS_IS = "as is"
    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"


@dataclass(frozen=True)
class OptLevel:
    """One row of the precision table.

    Attributes:
        name: "O0" ... "O3".
        brief: one line for tables and logs.
        description: what the level does and when to pick it.
        gemm: precision of the matrix multiplications of swapped layers.
        grad_comm: precision of gradients on the wire in data parallel.
        weight: storage of the weights of FP8 layers (always with a scale when low-bit).
        master_weight: storage of the optimizer's master copy, or None when there is none.
        weight_grad: storage of the weight gradients of FP8 layers.
        exp_avg: storage of Adam's first moment.
        exp_avg_sq: storage of Adam's second moment.
        shard_optimizer: master weights and optimizer state sharded over data-parallel ranks.
    """

    name: str
    brief: str
    description: str
    gemm: Precision
    grad_comm: Precision
    weight: Precision
    master_weight: Precision | None
    weight_grad: Precision
    exp_avg: Precision
    exp_avg_sq: Precision
    shard_optimizer: bool = False

    def __post_init__(self) -> None:
        for field in ("name", "brief", "description"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"OptLevel.{field}={value!r} is not valid; use a non-empty str")
        for field in _PRECISION_COLUMNS:
            value = getattr(self, field)
            if value is None and field == "master_weight":
                continue
            try:
                object.__setattr__(self, field, Precision(value))
            except ValueError:
                options = ", ".join(repr(p.value) for p in Precision)
                none = " or None" if field == "master_weight" else ""
                raise ValueError(f"OptLevel.{field}={value!r} is not valid; use one of {options}{none}") from None
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"OptLevel.shard_optimizer={self.shard_optimizer!r} is not valid; use True or False")

    @property
    def swaps_layers(self) -> bool:
        """Whether this level replaces eligible layers with FP8 ones."""
        return self.gemm is Precision.FP8

    @property
    def takes_over_optimizer(self) -> bool:
        """Whether this level stores weights or their gradients in a way only amp8's
        optimizer can step (any scaled storage); otherwise any optimizer keeps working."""
        return self.swaps_layers and (self.weight is not Precision.AS_IS or self.weight_grad is not Precision.AS_IS)

    def columns(self) -> dict[str, str]:
        """The table's columns as display strings, in table order."""
        def show(value: Precision | None, scaled: bool = False) -> str:
            if value is None:
                return "n/a"
            text = value.value.upper() if value is not Precision.AS_IS else value.value
            return f"{text} + scale" if scaled and value in (Precision.FP8, Precision.FP16) else text

        sharded = ", sharded" if self.shard_optimizer else ""
        return {
            "GEMM compute": show(self.gemm),
            "grad comm": show(self.grad_comm),
            "weights": show(self.weight, scaled=True),
            "master weights": show(self.master_weight, scaled=True) + sharded * (self.master_weight is not None),
            "weight grads": show(self.weight_grad),
            "Adam m + v": f"{show(self.exp_avg)} + {show(self.exp_avg_sq)}{sharded}",
        }


_PRECISION_COLUMNS = (
    "gemm", "grad_comm", "weight", "master_weight", "weight_grad", "exp_avg", "exp_avg_sq",
)
_FP32, _FP16, _FP8, _AS_IS = Precision.FP32, Precision.FP16, Precision.FP8, Precision.AS_IS

O0 = OptLevel(
    name="O0",
    brief="Baseline: the model and optimizer exactly as they are.",
    description=(
        "Changes nothing, so the same training loop gives the reference run to compare "
        "the FP8 levels against (FP32, or BF16 under the caller's autocast)."
    ),
    gemm=_AS_IS, grad_comm=_AS_IS, weight=_AS_IS, master_weight=None,
    weight_grad=_AS_IS, exp_avg=_FP32, exp_avg_sq=_FP32,
)
O1 = OptLevel(
    name="O1",
    brief="FP8 GEMMs, FP16 weights, FP8 weight gradients, FP32 Adam state.",
    description=(
        "Linear layers compute in FP8 and keep their weights in FP16 with a scale; weight "
        "gradients are stored and communicated in FP8. The optimizer state stays FP32: the "
        "safest FP8 level, about 11 bytes per parameter of FP8 layers."
    ),
    gemm=_FP8, grad_comm=_FP8, weight=_FP16, master_weight=None,
    weight_grad=_FP8, exp_avg=_FP32, exp_avg_sq=_FP32,
)
O2 = OptLevel(
    name="O2",
    brief="O1 plus FP8 first moment and FP16 second moment in Adam.",
    description=(
        "Everything O1 does, and Adam keeps its first moment in FP8 (rounded "
        "stochastically) and its second in FP16, each with a scale: about 6 bytes per "
        "parameter instead of 16."
    ),
    gemm=_FP8, grad_comm=_FP8, weight=_FP16, master_weight=None,
    weight_grad=_FP8, exp_avg=_FP8, exp_avg_sq=_FP16,
)
O3 = OptLevel(
    name="O3",
    brief="O2 plus FP8 weights and FP16 master weights, sharded over ranks.",
    description=(
        "Weights live in FP8 and feed the FP8 GEMMs directly; the optimizer keeps FP16 "
        "master weights, and with data parallel it shards them and its state over ranks."
    ),
    gemm=_FP8, grad_comm=_FP8, weight=_FP8, master_weight=_FP16,
    weight_grad=_FP8, exp_avg=_FP8, exp_avg_sq=_FP16, shard_optimizer=True,
)

LEVELS: Mapping[str, OptLevel] = MappingProxyType({level.name: level for level in (O0, O1, O2, O3)})

FP8_COMPUTE_ONLY = OptLevel(
    name="O1-compute",
    brief="FP8 GEMMs only: weights, gradients and the optimizer stay as the model has them.",
    description=(
        "Linear layers compute in FP8, but each weight stays in its own dtype and its "
        "gradient goes to param.grad in that dtype, so any optimizer, trainer, clipping "
        "and DDP see a plain model. No memory is saved; the GEMMs are FP8."
    ),
    gemm=_FP8, grad_comm=_AS_IS, weight=_AS_IS, master_weight=None,
    weight_grad=_AS_IS, exp_avg=_AS_IS, exp_avg_sq=_AS_IS,
)


def resolve_level(opt_level: str | OptLevel) -> OptLevel:
    """The ``OptLevel`` named by ``opt_level`` (a name such as "O2", or an ``OptLevel``).

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    if isinstance(opt_level, OptLevel):
        return opt_level
    if isinstance(opt_level, str) and opt_level in LEVELS:
        return LEVELS[opt_level]
    if opt_level == FP8_COMPUTE_ONLY.name:
        return FP8_COMPUTE_ONLY
    hint = ""
    if isinstance(opt_level, str) and opt_level[:1] == "0":
        hint = " (the prefix is the letter O, not the digit zero)"
    names = ", ".join(repr(name) for name in (*LEVELS, FP8_COMPUTE_ONLY.name))
    raise ValueError(f"opt_level={opt_level!r} is not an amp8 opt level{hint}; use one of {names}")


def override(opt_level: str | OptLevel, **columns: Any) -> OptLevel:
    """A copy of a level with some columns changed, e.g. ``override("O2", exp_avg="fp32")``.

    Values may be ``Precision`` members or their strings. The result keeps the level's
    name with a ``+`` so reports show that it is not a stock level.

    Raises:
        ValueError: for an unknown column or a precision that column cannot take.
    """
    base = resolve_level(opt_level)
    allowed = _ALLOWED_PRECISIONS
    changes: dict[str, Any] = {}
    for column, value in columns.items():
        if column not in allowed:
            raise ValueError(
                f"override({column}={value!r}) is not valid; the columns that can be "
                f"overridden are {', '.join(sorted(allowed))}"
            )
        try:
            precision = None if value is None else Precision(value)
        except ValueError:
            precision = object()  # rejected just below with the allowed list
        if precision not in allowed[column]:
            options = ", ".join(repr(None if p is None else p.value) for p in allowed[column])
            raise ValueError(f"override({column}={value!r}) is not valid; use one of {options}")
        changes[column] = precision
    return dataclasses.replace(base, name=base.name.rstrip("+") + "+", **changes)


_ALLOWED_PRECISIONS: Mapping[str, tuple[Precision | None, ...]] = MappingProxyType({
    "exp_avg": (_FP32, _FP8),
    "exp_avg_sq": (_FP32, _FP16),
})
