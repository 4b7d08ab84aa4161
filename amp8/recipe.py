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


class Granularity(str, Enum):
    """How many scales a tensor gets.

    TENSORWISE: one scale per tensor.
    ROWWISE: one scale per row of each GEMM operand, taken along the GEMM's contraction
        dimension (torchao's "rowwise"/axiswise recipes).
    BLOCK: one scale per ``1 x block_size`` tile of activations and output gradients
        (``block_size x 1`` where a GEMM contracts over rows) and per
        ``block_size x block_size`` block of weights (the DeepSeek-V3 recipe).
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCK = "block"


class RecipeName(str, Enum):
    """Names of the recipes ``Recipe.preset`` builds."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    DEEPSEEK = "deepseek"


class AmaxAlgo(str, Enum):
    """How delayed scaling reduces the amax history to one number."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def _as_enum(enum_type: type[Enum], field: str, value: Any, *, label: str | None = None) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)  # type: ignore[attr-defined]
        what = label or f"Recipe.{field}={value!r}"
        raise ValueError(f"{what} is not valid; use one of {allowed}") from None


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
        granularity: "tensorwise" (one scale per tensor), "rowwise" (one per row along each
            GEMM's contraction dimension) or "block" (1 x block_size tiles for activations
            and gradients, block_size x block_size blocks for weights).
        block_size: elements per tile edge under "block": a multiple of 16. A dimension
            that is not a multiple of it ends in a partial tile with its own scale.
    """

    fp8_format: Fp8Format = Fp8Format.HYBRID
    scaling: Scaling = Scaling.CURRENT
    amax_history_len: int = 16
    amax_compute_algo: AmaxAlgo = AmaxAlgo.MAX
    margin: int = 0
    power_of_2_scales: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    granularity: Granularity = Granularity.TENSORWISE
    block_size: int = 128

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
        set_field(self, "granularity", _as_enum(Granularity, "granularity", self.granularity))
        block = self.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block % 16:
            raise ValueError(
                f"Recipe.block_size={block!r} is not valid; use a positive multiple of 16 "
                "(FP8 GEMMs need K-blocks that are multiples of 16), such as 128"
            )
        if self.scaling is Scaling.DELAYED and self.granularity is not Granularity.TENSORWISE:
            raise ValueError(
                f"Recipe(scaling='delayed', granularity={self.granularity.value!r}) is not "
                "supported: delayed scaling keeps one amax history per tensor. Use "
                "scaling='current' with fine-grained scales, or granularity='tensorwise' "
                "with delayed scaling"
            )

    @classmethod
    def preset(cls, name: "str | RecipeName") -> "Recipe":
        """A named recipe.

        "tensorwise": ``Recipe()``, one scale per tensor, HYBRID formats.
        "rowwise": E4M3 everywhere, power-of-two scales, one scale per row along each
            GEMM's contraction dimension (as torchao's rowwise recipe).
        "deepseek": E4M3 everywhere, power-of-two scales, 1x128 tiles for activations and
            gradients and 128x128 blocks for weights (the DeepSeek-V3 recipe).

        Raises:
            ValueError: an unknown name; the message lists the valid ones.
        """
        recipe_name = _as_enum(RecipeName, "name", name, label=f"Recipe.preset({name!r})")
        if recipe_name is RecipeName.TENSORWISE:
            return cls()
        granularity = Granularity.ROWWISE if recipe_name is RecipeName.ROWWISE else Granularity.BLOCK
        return cls(fp8_format=Fp8Format.E4M3, power_of_2_scales=True, granularity=granularity)

    def tile(
        self, shape: tuple[int, ...], contract_dim: int, *, weight: bool = False
    ) -> tuple[int, int] | None:
        """The (rows, columns) tile that shares one scale in a 2-D GEMM operand of
        ``shape`` contracted along ``contract_dim`` (0 or 1); None for one scale per tensor.
        Weights under "block" take square blocks, which serve both dims."""
        if self.granularity is Granularity.TENSORWISE:
            return None
        if self.granularity is Granularity.BLOCK and weight:
            return (self.block_size, self.block_size)
        span = shape[contract_dim] if self.granularity is Granularity.ROWWISE else self.block_size
        return (1, span) if contract_dim == 1 else (span, 1)

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def history_len(self) -> int:
        """Entries of amax history a layer keeps: the recipe's length when delayed, else 1."""
        return self.amax_history_len if self.scaling is Scaling.DELAYED else 1
