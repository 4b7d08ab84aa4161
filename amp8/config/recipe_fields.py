"""The recipe's fields: the enums they take, their limits, and the checks and tile rule
that ``amp8.config.recipe.Recipe`` builds on."""

from __future__ import annotations

from enum import Enum
from typing import Any

MAX_HISTORY_LEN = 1024
"""The longest amax history: the largest in common use (Transformer Engine's default);
a longer one reacts to a change of range more slowly still and costs a reduction over it
per cast."""
MAX_BLOCK_SIZE = 1024
"""The largest ``block_size``: weights are padded to whole ``block_size x block_size``
blocks when their amax is taken, so a larger block costs memory and gains nothing."""


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


GRANULARITY_LADDER: tuple[Granularity, ...] = (Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCK)
"""Granularities from coarsest to finest: the rungs ``amp8.Controller`` steps a layer up."""


class WeightGradFormat(str, Enum):
    """The FP8 dtype a stored weight gradient takes.

    GRADIENT: the recipe's gradient dtype (E5M2 under HYBRID, E4M3 under E4M3).
    E4M3: E4M3 (one more mantissa bit than E5M2; its scales give the range).
    E5M2: E5M2.
    """

    GRADIENT = "gradient"
    E4M3 = "E4M3"
    E5M2 = "E5M2"


class WeightGradScaling(str, Enum):
    """How many scales a stored weight gradient gets.

    WEIGHT: the tiles of the weight's own FP8 scales (one per tensor under "tensorwise").
    ROWWISE: one scale per row (output feature) of the gradient.
    """

    WEIGHT = "weight"
    ROWWISE = "rowwise"


class ActivationFormat(str, Enum):
    """How tensors saved for backward inside the model are stored.

    HIGH: as the forward made them (FP32, or BF16 under autocast).
    FP8: E4M3 with one scale per 1 x 128 tile along the last dimension
        (``amp8.nn.activations``); FP8 layers of every granularity keep their FP8 input.
    """

    HIGH = "high"
    FP8 = "fp8"


class OutputHead(str, Enum):
    """How ``amp8.initialize`` treats the model's output head: the ``nn.Linear`` that maps
    hidden states to the vocabulary's logits, or a classifier's head (the last GEMM layer,
    with ``model.config.num_labels`` outputs), found by structure (``amp8.nn.swap.output_heads``).

    HIGH: it stays in high precision (``initialize``'s default: its logits feed the
        loss directly, and measured runs lose most of their FP8 gap there).
    FP8: it runs in FP8 like any other eligible layer (the field's default).
    """

    HIGH = "high"
    FP8 = "fp8"


class RecipeName(str, Enum):
    """Names of the recipes ``Recipe.preset`` builds."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    DEEPSEEK = "deepseek"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"


class Microscaling(str, Enum):
    """The Blackwell microscaled format of the GEMM operands (``amp8.tensor.block_scaled``).

    NONE: FP8 with float32 scales, at the recipe's granularity.
    MXFP8: FP8 elements with one E8M0 (power-of-two) scale per 32 along each GEMM's
        contraction dimension.
    NVFP4: FP4 (E2M1) elements with one E4M3 scale per 16 and one tensor scale.
    """

    NONE = "none"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"


MICRO_BLOCK_SIZES = {Microscaling.MXFP8: 32, Microscaling.NVFP4: 16}
"""The block size each microscaled format fixes."""


class AmaxAlgo(str, Enum):
    """How delayed scaling reduces the amax history to one number."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def operand_tile(
    granularity: Granularity, block_size: int, shape: tuple[int, ...], contract_dim: int, *, weight: bool = False
) -> tuple[int, int] | None:
    """The (rows, columns) tile that shares one scale in a 2-D GEMM operand of ``shape``
    contracted along ``contract_dim`` (0 or 1) under ``granularity``; None for one scale
    per tensor. Weights under "block" take square ``block_size`` blocks, which serve both
    dims; other operands take ``1 x block_size`` tiles along the contraction."""
    if granularity is Granularity.TENSORWISE:
        return None
    if granularity is Granularity.BLOCK and weight:
        return (block_size, block_size)
    span = shape[contract_dim] if granularity is Granularity.ROWWISE else block_size
    return (1, span) if contract_dim == 1 else (span, 1)


def check_int(field: str, value: Any, low: int, high: int, why: str = "", *, multiple_of: int = 1) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) in ``[low, high]`` and
    a multiple of ``multiple_of``; the message gives the range and ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high or value % multiple_of:
        multiple = f" that is a multiple of {multiple_of}" if multiple_of > 1 else ""
        raise ValueError(
            f"Recipe.{field}={value!r} is not valid; use an int in [{low}, {high}]{multiple} {why}".rstrip()
        )


def as_enum(enum_type: type[Enum], field: str, value: Any, *, label: str | None = None) -> Any:
    """``value`` as a member of ``enum_type`` (a member, or its value such as "rowwise").

    Raises:
        ValueError: any other value; the message names the field and lists the valid values.
    """
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)  # type: ignore[attr-defined]
        what = label or f"Recipe.{field}={value!r}"
        raise ValueError(f"{what} is not valid; use one of {allowed}") from None


def check_outlier_split(recipe: Any) -> None:
    """Validate a recipe's ``wgrad_outlier_split`` and ``wgrad_outlier_share``.

    Raises:
        ValueError: a value the field cannot take, or the split without scales along tokens.
    """
    if not isinstance(recipe.wgrad_outlier_split, bool):
        raise ValueError(f"Recipe.wgrad_outlier_split={recipe.wgrad_outlier_split!r} is not valid; use True or False")
    share = recipe.wgrad_outlier_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 0.5:
        raise ValueError(f"Recipe.wgrad_outlier_share={share!r} is not valid; use a share of tokens in (0, 0.5]")
    if recipe.wgrad_outlier_split and recipe.granularity is Granularity.TENSORWISE:
        raise ValueError(
            "Recipe(wgrad_outlier_split=True) needs scales along tokens for wgrad, which one scale per "
            "tensor does not cast; use granularity='rowwise' or 'block'"
        )

def check_microscaling(recipe: Any) -> None:
    """Validate a recipe's microscaling fields and ``high_precision_layers`` (normalized
    to a tuple), as ``Recipe``'s docstring describes them.

    Raises:
        ValueError: a value a field cannot take, or a field its microscaled format fixes
            otherwise; the message names what to use.
    """
    for name in ("weight_block_2d", "wgrad_hadamard", "stochastic_grad_rounding"):
        if not isinstance(getattr(recipe, name), bool):
            raise ValueError(f"Recipe.{name}={getattr(recipe, name)!r} is not valid; use True or False")
    layers = recipe.high_precision_layers
    if isinstance(layers, str) or not isinstance(layers, (tuple, list)) or not all(
        isinstance(pattern, str) for pattern in layers
    ):
        raise ValueError(
            f"Recipe.high_precision_layers={layers!r} is not valid; use a tuple of fnmatch patterns "
            "of layer names, e.g. ('blocks.11.*',)"
        )
    object.__setattr__(recipe, "high_precision_layers", tuple(layers))
    micro = recipe.microscaling
    if micro is Microscaling.NONE:
        knobs = [name for name in ("weight_block_2d", "wgrad_hadamard", "stochastic_grad_rounding")
                 if getattr(recipe, name)]
        if knobs:
            raise ValueError(
                f"Recipe({', '.join(f'{name}=True' for name in knobs)}) needs a microscaled format; "
                "use Recipe.preset('nvfp4') or set microscaling='mxfp8' or 'nvfp4'"
            )
        return
    block = MICRO_BLOCK_SIZES[micro]
    wrong = []
    if recipe.granularity is not Granularity.BLOCK or recipe.block_size != block:
        wrong.append(f"granularity='block', block_size={block}")
    if recipe.scaling is not Scaling.CURRENT:
        wrong.append("scaling='current'")
    if micro is Microscaling.MXFP8 and not recipe.power_of_2_scales:
        wrong.append("power_of_2_scales=True (E8M0 scales are powers of two)")
    if micro is Microscaling.NVFP4 and (recipe.power_of_2_scales or recipe.margin):
        wrong.append("power_of_2_scales=False and margin=0 (NVFP4 scales are E4M3)")
    if micro is Microscaling.MXFP8 and recipe.stochastic_grad_rounding:
        wrong.append("stochastic_grad_rounding=False (it rounds FP4 gradients)")
    if recipe.activations is not ActivationFormat.HIGH:
        wrong.append("activations='high'")
    if wrong:
        raise ValueError(
            f"Recipe(microscaling={micro.value!r}) needs {'; '.join(wrong)}; "
            f"start from Recipe.preset({micro.value!r})"
        )
