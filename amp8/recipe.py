"""The FP8 recipe: how tensors are scaled and cast, independent of the opt level."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .formats import Fp8Format


class Scaling(str, Enum):
    """Where a tensor's scale comes from.

    CURRENT: from the tensor's own absolute maximum, just before the cast.
    DELAYED: from a history of the absolute maxima of earlier iterations.
    NONE: no scaling at all (scale 1), an ablation that shows why scaling matters.
    """

    CURRENT = "current"
    DELAYED = "delayed"
    NONE = "none"


class AmaxAlgo(str, Enum):
    """How delayed scaling reduces the amax history to one number."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def _as_enum(enum_type: type[Enum], field: str, value: Any) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)  # type: ignore[attr-defined]
        raise ValueError(f"Recipe.{field}={value!r} is not valid; use one of {allowed}") from None


@dataclass(frozen=True)
class Recipe:
    """How amp8 scales and casts the tensors of its FP8 layers.

    Attributes:
        fp8_format: "HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3" (E4M3 everywhere).
        scaling: "current" (scale from the tensor itself), "delayed" (from amax history)
            or "none" (every scale is 1: the plain cast, for ablations only).
        amax_history_len: iterations of amax kept per tensor under delayed scaling.
        amax_compute_algo: "max" over the history or its "most_recent" entry.
        margin: the scale is divided by ``2**margin`` to leave headroom.
        power_of_2_scales: round every scale down to a power of two (exact rescaling).
        override_linear_precision: run (fprop, dgrad, wgrad) in high precision where True.
    """

    fp8_format: Fp8Format = Fp8Format.HYBRID
    scaling: Scaling = Scaling.CURRENT
    amax_history_len: int = 16
    amax_compute_algo: AmaxAlgo = AmaxAlgo.MAX
    margin: int = 0
    power_of_2_scales: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "fp8_format", _as_enum(Fp8Format, "fp8_format", self.fp8_format))
        set_field(self, "scaling", _as_enum(Scaling, "scaling", self.scaling))
        set_field(
            self,
            "amax_compute_algo",
            _as_enum(AmaxAlgo, "amax_compute_algo", self.amax_compute_algo),
        )
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise ValueError(
                f"Recipe.amax_history_len={self.amax_history_len!r} is not valid; use an int >= 1"
            )
        if self.amax_history_len < 1:
            raise ValueError(
                f"Recipe.amax_history_len={self.amax_history_len} is not valid; use an int >= 1"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Recipe.margin={self.margin!r} is not valid; use an int >= 0")
        if not isinstance(self.power_of_2_scales, bool):
            raise ValueError(
                f"Recipe.power_of_2_scales={self.power_of_2_scales!r} is not valid; use True or False"
            )
        override = self.override_linear_precision
        if (
            not isinstance(override, (tuple, list))
            or len(override) != 3
            or not all(isinstance(flag, bool) for flag in override)
        ):
            raise ValueError(
                f"Recipe.override_linear_precision={override!r} is not valid; use three bools "
                "(fprop, dgrad, wgrad), True meaning that GEMM runs in high precision"
            )
        set_field(self, "override_linear_precision", tuple(override))

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def history_len(self) -> int:
        """Entries of amax history a layer keeps: the recipe's length when delayed, else 1."""
        return self.amax_history_len if self.scaling is Scaling.DELAYED else 1
