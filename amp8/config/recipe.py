"""The FP8 recipe: how tensors are scaled and cast, independent of the opt level.

``Recipe`` is the common base and the FP8 family (one, per-row or per-block float32
scales); ``MXFP8Recipe`` and ``NVFP4Recipe`` are the Blackwell microscaled families, each
fixing the fields its format decides, so a combination the format cannot run cannot be
written. The fields' enums and checks are in ``amp8.config.recipe_fields``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from amp8.config.formats import E4M3, E5M2, E8M0, Fp8Format, gradient_dtype, max_margin
from amp8.config.recipe_fields import (
    GRANULARITY_LADDER, MAX_BLOCK_SIZE, MAX_HISTORY_LEN, MICRO_BLOCK_SIZES, ActivationFormat, AmaxAlgo,
    Granularity, Microscaling, OutputHead, RecipeName, Scaling, WeightGradFormat, WeightGradScaling, as_enum,
    check_int, check_microscaling, check_outlier_split, operand_tile,
)

__all__ = [
    "GRANULARITY_LADDER", "MAX_BLOCK_SIZE", "MAX_HISTORY_LEN", "MICRO_BLOCK_SIZES", "ActivationFormat", "AmaxAlgo",
    "FAMILIES", "Granularity", "MXFP8Recipe", "Microscaling", "NVFP4Recipe", "OutputHead", "Recipe", "RecipeName", "Scaling",
    "WeightGradFormat", "WeightGradScaling", "operand_tile",
]


@dataclass(frozen=True)
class Recipe:
    """How amp8 scales and casts the tensors of its FP8 layers.

    Attributes:
        fp8_format: "HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3" (E4M3 everywhere).
        scaling: "current" (scale from the tensor itself), "delayed" (from amax history)
            or "none" (every scale is 1: the plain cast, for ablations only).
        amax_history_len: iterations of amax kept per tensor under delayed scaling, 1 to
            1024.
        amax_compute_algo: "max" over the history or its "most_recent" entry.
        margin: the scale is divided by ``2**margin`` to leave headroom; 0 to 14 (beyond
            that the amax leaves E4M3's normal range, see ``formats.max_margin``).
        power_of_2_scales: round every scale down to a power of two (exact rescaling).
        override_linear_precision: run (fprop, dgrad, wgrad) in high precision where True.
        granularity: "tensorwise" (one scale per tensor), "rowwise" (one per row along each
            GEMM's contraction dimension) or "block" (1 x block_size tiles for activations
            and gradients, block_size x block_size blocks for weights).
        block_size: elements per tile edge under "block": a multiple of 16 from 16 to
            1024. A dimension that is not a multiple of it ends in a partial tile with its
            own scale.
        weight_grad_format: the FP8 dtype of stored weight gradients: "E4M3" (the
            default: its scale gives the range, its extra mantissa bit the precision),
            "E5M2", or "gradient" (the format's gradient dtype; E5M2 under HYBRID, as
            amp8 0.1 stored them). The stored gradient always takes fresh scales from its
            own amax, also under delayed scaling, so E4M3's narrower range costs nothing
            but values more than 2**17 below the amax of their tile.
        weight_grad_scaling: the scales of stored weight gradients: "weight" (the tiles
            of the weight's FP8 scales) or "rowwise" (one per output feature).
        activations: how tensors autograd saves for backward inside the model are
            stored: "high" (as they are, the default) or "fp8" (E4M3 with one scale per
            1 x 128 tile along the last dimension, restored in backward; FP8 layers of
            every granularity then keep their FP8 input for the weight gradient).
        microscaling: "none", "mxfp8" or "nvfp4" (set by ``MXFP8Recipe`` and
            ``NVFP4Recipe``; passing it to ``Recipe`` is deprecated): the GEMM operands
            take the Blackwell microscaled format (granularity "block" with its block size, 32 or 16:
            1 x block tiles along each GEMM's contraction dimension, weights included).
            Weight gradients and the first moment stay E4M3 with float32 scales at the
            weight's tiles.
        weight_block_2d: under microscaling, weights take square ``block_size`` blocks
            (16 x 16 under NVFP4), so fprop and dgrad see the same quantized weight.
        wgrad_hadamard: under microscaling, both weight-gradient operands are rotated
            along tokens by a 16 x 16 random Hadamard transform before their cast
            (``amp8.quant.hadamard``; the product is unchanged, outliers are spread).
        stochastic_grad_rounding: under NVFP4, output gradients round to FP4
            stochastically (unbiased), with noise keyed by the gradient's own bits.
        wgrad_outlier_split: the weight-gradient GEMM takes its outlier tokens out: the
            tokens whose input or output-gradient row amax exceeds the median row's more
            than ``amp8.nn.outlier_split.OUTLIER_ROW_RATIO`` (2**8) times, at most
            ``wgrad_outlier_share`` of them, are multiplied in float32, the rest in FP8,
            whose scales along tokens the outliers then no longer set. Needs a
            granularity finer than tensorwise (the casts along tokens are made for
            wgrad). ``amp8.Controller`` turns it on for a layer whose wgrad casts fail.
        wgrad_outlier_share: the most tokens, as a share in (0, 0.5], that the split
            takes out (at least one token a GEMM): the rows of its float32 product, so
            the weight-gradient FLOPs it costs in float32.
        high_precision_layers: ``fnmatch`` patterns of layer names (as in
            ``model.named_modules()``) that ``amp8.initialize`` keeps in high precision,
            e.g. ``("blocks.11.*", "head")`` for the last block and the head.
        output_head: "fp8" (the field's default) runs the model's output head (the
            Linear that maps hidden states to the vocabulary, or a classifier's head,
            found by structure) in FP8 like any other layer; "high" keeps it in high
            precision.

    The field defaults are the tensorwise recipe. ``amp8.initialize`` without a recipe
    uses ``amp8.frontend.default_recipe``: the rowwise preset with the head high.
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
    weight_grad_format: WeightGradFormat = WeightGradFormat.E4M3
    weight_grad_scaling: WeightGradScaling = WeightGradScaling.WEIGHT
    activations: ActivationFormat = ActivationFormat.HIGH
    microscaling: Microscaling = Microscaling.NONE
    weight_block_2d: bool = False
    wgrad_hadamard: bool = False
    stochastic_grad_rounding: bool = False
    wgrad_outlier_split: bool = False
    wgrad_outlier_share: float = 1 / 4
    high_precision_layers: tuple[str, ...] = ()
    output_head: OutputHead = OutputHead.FP8

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "microscaling", as_enum(Microscaling, "microscaling", self.microscaling))
        if type(self) is Recipe and self.microscaling is not Microscaling.NONE:
            family = FAMILIES[self.microscaling].__name__
            warnings.warn(
                f"Recipe(microscaling={self.microscaling.value!r}) is deprecated and will be refused in a "
                f"future release; use amp8.config.{family}(...) or Recipe.preset({self.microscaling.value!r})",
                DeprecationWarning, stacklevel=3,
            )
        set_field(self, "fp8_format", as_enum(Fp8Format, "fp8_format", self.fp8_format))
        set_field(self, "scaling", as_enum(Scaling, "scaling", self.scaling))
        set_field(
            self,
            "amax_compute_algo",
            as_enum(AmaxAlgo, "amax_compute_algo", self.amax_compute_algo),
        )
        check_int("amax_history_len", self.amax_history_len, 1, MAX_HISTORY_LEN)
        check_int(
            "margin", self.margin, 0, max_margin(self.fp8_format),
            f"(a larger margin puts the amax below the normal range of the {self.fp8_format.value} "
            "format's FP8 dtypes and flushes the rest of the tensor to zero)",
        )
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
        set_field(self, "granularity", as_enum(Granularity, "granularity", self.granularity))
        set_field(self, "weight_grad_format",
                  as_enum(WeightGradFormat, "weight_grad_format", self.weight_grad_format))
        set_field(self, "weight_grad_scaling",
                  as_enum(WeightGradScaling, "weight_grad_scaling", self.weight_grad_scaling))
        set_field(self, "activations", as_enum(ActivationFormat, "activations", self.activations))
        set_field(self, "output_head", as_enum(OutputHead, "output_head", self.output_head))
        check_int(
            "block_size", self.block_size, 16, MAX_BLOCK_SIZE,
            "(FP8 GEMMs need K-blocks that are multiples of 16), such as 128", multiple_of=16,
        )
        if self.scaling is Scaling.DELAYED and self.granularity is not Granularity.TENSORWISE:
            raise ValueError(
                f"Recipe(scaling='delayed', granularity={self.granularity.value!r}) is not "
                "supported: delayed scaling keeps one amax history per tensor. Use "
                "scaling='current' with fine-grained scales, or granularity='tensorwise' "
                "with delayed scaling"
            )
        check_microscaling(self)
        check_outlier_split(self)

    @property
    def square_weight_blocks(self) -> bool:
        """Whether weights under "block" take square blocks: always without
        microscaling (the DeepSeek-V3 recipe), with it only under ``weight_block_2d``."""
        return self.microscaling is Microscaling.NONE or self.weight_block_2d

    @classmethod
    def preset(cls, name: "str | RecipeName") -> "Recipe":
        """A named recipe.

        "tensorwise": ``Recipe()``, one scale per tensor, HYBRID formats: the fastest
            casts (one amax per tensor), at a larger loss gap.
        "rowwise": E4M3 everywhere, power-of-two scales, one scale per row along each
            GEMM's contraction dimension (as torchao's rowwise recipe); with
            ``output_head="high"``, what ``amp8.initialize`` uses when it is given no
            recipe (but for O3 with a sharded optimizer).
        "deepseek": E4M3 everywhere, power-of-two scales, 1x128 tiles for activations and
            gradients and 128x128 blocks for weights (the DeepSeek-V3 recipe).
        "mxfp8": MXFP8: E4M3 everywhere, one E8M0 scale per 1 x 32 tile along each GEMM's
            contraction dimension (Transformer Engine's MXFP8BlockScaling).
        "nvfp4": NVFP4: E2M1 elements, E4M3 scales per 1 x 16 tile and a tensor scale;
            16 x 16 weight blocks, the random Hadamard transform on wgrad's operands and
            stochastic rounding of gradients (Transformer Engine's NVFP4BlockScaling).
            Layers to keep in high precision (``high_precision_layers``) depend on the
            model and are left empty.

        Raises:
            ValueError: an unknown name; the message lists the valid ones.
        """
        recipe_name = as_enum(RecipeName, "name", name, label=f"Recipe.preset({name!r})")
        if recipe_name is RecipeName.TENSORWISE:
            return Recipe()
        if recipe_name is RecipeName.MXFP8:
            return MXFP8Recipe()
        if recipe_name is RecipeName.NVFP4:
            return NVFP4Recipe()
        granularity = Granularity.ROWWISE if recipe_name is RecipeName.ROWWISE else Granularity.BLOCK
        return Recipe(fp8_format=Fp8Format.E4M3, power_of_2_scales=True, granularity=granularity)

    @property
    def scale_block_size(self) -> int:
        """Elements per block edge of the weight's scales (``block_size`` under "block",
        else 0)."""
        return self.block_size if self.granularity is Granularity.BLOCK else 0

    def tile(
        self, shape: tuple[int, ...], contract_dim: int, *, weight: bool = False
    ) -> tuple[int, int] | None:
        """The (rows, columns) tile that shares one scale in a 2-D GEMM operand of
        ``shape`` contracted along ``contract_dim`` (0 or 1); None for one scale per tensor.
        Weights under "block" take square blocks, which serve both dims (under
        microscaling only with ``weight_block_2d``)."""
        return operand_tile(
            self.granularity, self.block_size, shape, contract_dim, weight=weight and self.square_weight_blocks
        )

    @property
    def weight_grad_dtype(self) -> "torch.dtype":
        """The FP8 dtype of stored weight gradients (``weight_grad_format``)."""
        chosen = self.weight_grad_format
        if chosen is WeightGradFormat.GRADIENT:
            return gradient_dtype(self.fp8_format)
        return E4M3 if chosen is WeightGradFormat.E4M3 else E5M2

    @property
    def stored_scale_dtype(self) -> "torch.dtype":
        """The dtype of the scales of FP8 weights and Adam's FP8 first moment, as stored:
        one-byte E8M0 under MXFP8 (its scales are powers of two), else float32. Weight
        gradients keep float32 scales, which clipping rescales by any factor, exactly."""
        return E8M0 if self.microscaling is Microscaling.MXFP8 else torch.float32

    def weight_grad_tile(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The (rows, columns) tile sharing one scale in a stored weight gradient of
        ``shape`` (of each matrix, for a stack of them); None for one scale per tensor."""
        if self.weight_grad_scaling is WeightGradScaling.ROWWISE:
            return (1, shape[-1])
        return self.tile(shape[-2:], 1, weight=True)

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with ``changes`` applied and validated again.

        Raises:
            TypeError: a name that is not a field of ``Recipe``; the message lists them.
            ValueError: a value the field cannot take (see the class docstring), or a
                change of a field that this recipe's format family fixes.
        """
        fields = {item.name: item for item in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise TypeError(f"Recipe.replace got unknown fields {unknown}; the fields are {', '.join(fields)}")
        for name in [name for name in changes if not fields[name].init]:
            if changes.pop(name) != getattr(self, name):
                raise ValueError(
                    f"{type(self).__name__} fixes {name}={getattr(getattr(self, name), 'value', getattr(self, name))!r}: "
                    "another value is "
                    "another format; start from Recipe() or Recipe.preset(...) for it"
                )
        return dataclasses.replace(self, **changes)

    def for_gemms(
        self, granularity: Granularity, high_precision: tuple[bool, bool, bool], outlier_split: bool = False
    ) -> "Recipe":
        """This recipe with the GEMMs at ``granularity``, ``high_precision`` as
        ``override_linear_precision`` and ``outlier_split`` as ``wgrad_outlier_split``;
        current scaling where a finer granularity cannot keep delayed scaling's one amax
        history per tensor."""
        granularity = as_enum(Granularity, "granularity", granularity)
        delayed = self.scaling is Scaling.DELAYED and granularity is not Granularity.TENSORWISE
        return self.replace(
            granularity=granularity,
            override_linear_precision=tuple(high_precision),
            scaling=Scaling.CURRENT if delayed else self.scaling,
            wgrad_outlier_split=outlier_split,
        )

    @property
    def history_len(self) -> int:
        """Entries of amax history a layer keeps: the recipe's length when delayed, else 1."""
        return self.amax_history_len if self.scaling is Scaling.DELAYED else 1


def _fixed(value: Any) -> Any:
    """A field a format family decides: not an argument of the family's constructor."""
    return field(default=value, init=False)


@dataclass(frozen=True)
class MXFP8Recipe(Recipe):
    """MXFP8 (Transformer Engine's MXFP8BlockScaling): E4M3 elements with one E8M0
    (power-of-two) scale per 1 x 32 tile along each GEMM's contraction dimension,
    weights included. The format fixes ``fp8_format``, ``scaling``,
    ``power_of_2_scales``, ``granularity``, ``block_size``, ``microscaling``,
    ``stochastic_grad_rounding`` and ``activations``; the other fields are ``Recipe``'s,
    with its defaults. ``MXFP8Recipe() == Recipe.preset("mxfp8")``.
    """

    fp8_format: Fp8Format = _fixed(Fp8Format.E4M3)
    scaling: Scaling = _fixed(Scaling.CURRENT)
    power_of_2_scales: bool = _fixed(True)
    granularity: Granularity = _fixed(Granularity.BLOCK)
    block_size: int = _fixed(MICRO_BLOCK_SIZES[Microscaling.MXFP8])
    activations: ActivationFormat = _fixed(ActivationFormat.HIGH)
    microscaling: Microscaling = _fixed(Microscaling.MXFP8)
    stochastic_grad_rounding: bool = _fixed(False)


@dataclass(frozen=True)
class NVFP4Recipe(Recipe):
    """NVFP4 (Transformer Engine's NVFP4BlockScaling): E2M1 elements, an E4M3 scale per
    1 x 16 tile and one tensor scale; by default 16 x 16 weight blocks, the random
    Hadamard transform on wgrad's operands and stochastic rounding of gradients, each a
    field to turn off. The format fixes ``fp8_format``, ``scaling``,
    ``power_of_2_scales``, ``margin``, ``granularity``, ``block_size``, ``microscaling``
    and ``activations``. ``NVFP4Recipe() == Recipe.preset("nvfp4")``.
    """

    fp8_format: Fp8Format = _fixed(Fp8Format.E4M3)
    scaling: Scaling = _fixed(Scaling.CURRENT)
    margin: int = _fixed(0)
    power_of_2_scales: bool = _fixed(False)
    granularity: Granularity = _fixed(Granularity.BLOCK)
    block_size: int = _fixed(MICRO_BLOCK_SIZES[Microscaling.NVFP4])
    activations: ActivationFormat = _fixed(ActivationFormat.HIGH)
    microscaling: Microscaling = _fixed(Microscaling.NVFP4)
    weight_block_2d: bool = True
    wgrad_hadamard: bool = True
    stochastic_grad_rounding: bool = True


FAMILIES: dict[Microscaling, type[Recipe]] = {
    Microscaling.NONE: Recipe, Microscaling.MXFP8: MXFP8Recipe, Microscaling.NVFP4: NVFP4Recipe,
}
"""The recipe class of each format family."""
