"""What an ``Fp8Linear`` checks and completes in a checkpoint before torch loads it.

A checkpoint may come from another opt level, another recipe, an older amp8 or a plain
``nn.Linear`` (the plain form has none of amp8's buffers): scales and amax histories are
checked, filled where missing and resized to this layer's history length; the GEMM
precision is taken only where it was made under this layer's recipe (see
``loaded_gemm_recipe``). The stored weight itself loads through
``amp8.nn.state_dict_form.load_stored_weight``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from amp8.config.recipe import Recipe
from amp8.nn.gemm_precision import decode_gemm_precision
from amp8.nn.state_dict_form import recipe_record, saved_recipe
from amp8.quant.checks import check_loaded_history, check_loaded_scales


def prepare_linear_state(
    state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any] | None, *, recipe: Recipe,
    gemm_recipe: Recipe, scale: torch.Tensor, amax_history: torch.Tensor, gemm_precision: torch.Tensor,
    hadamard: torch.Tensor | None,
) -> Recipe:
    """Check and complete the entries under ``prefix`` of ``state_dict`` for a layer of
    ``recipe`` whose GEMMs run under ``gemm_recipe`` now, holding the buffers given (its
    ``hadamard`` where the recipe rotates wgrad's operands, else None); returns the GEMM
    recipe the layer runs from here on: the checkpoint's (see ``loaded_gemm_recipe``) or,
    where it holds none, ``gemm_recipe``.

    Raises:
        ValueError: corrupt scales, amax history or GEMM precision; the message names
            the entry.
    """
    scale_key, history_key, precision_key = (prefix + name for name in ("scale", "amax_history", "gemm_precision"))
    if state_dict.get(scale_key) is not None:
        check_loaded_scales(scale_key, state_dict[scale_key])
    if state_dict.get(history_key) is not None:
        check_loaded_history(history_key, state_dict[history_key])
    saved_precision = state_dict.get(precision_key)
    if saved_precision is not None:
        loaded = loaded_gemm_recipe(recipe, precision_key, saved_precision, saved_recipe(local_metadata))
        gemm_recipe = recipe if loaded is None else loaded
    # The layer rewrites it from its GEMM recipe once loaded; a checkpoint from before the
    # GEMMs could move lacks it.
    state_dict[precision_key] = gemm_precision.clone()
    if hadamard is not None:  # a checkpoint of another recipe lacks it: keep this one's
        state_dict.setdefault(prefix + "hadamard", hadamard.clone())
    else:
        state_dict.pop(prefix + "hadamard", None)
    for key, buffer in ((scale_key, scale), (history_key, amax_history)):
        saved_buffer = state_dict.get(key)
        if saved_buffer is None:
            state_dict[key] = buffer.clone()
        elif saved_buffer.shape != buffer.shape:  # another amax_history_len
            resized = torch.zeros_like(buffer)
            length = min(saved_buffer.shape[-1], buffer.shape[-1])
            resized[..., :length] = saved_buffer[..., :length]
            state_dict[key] = resized
    return gemm_recipe


def loaded_gemm_recipe(
    recipe: Recipe, key: str, saved: torch.Tensor, saved_under: dict[str, Any] | None
) -> Recipe | None:
    """The GEMM recipe a checkpoint's ``gemm_precision`` tensor describes for a layer of
    ``recipe``; None, with a warning, where it was made under another recipe
    (``saved_under``, the checkpoint's ``recipe_record``) or one that ``recipe`` cannot
    take (a checkpoint without a record).

    Raises:
        ValueError: ``saved`` is no GEMM precision (see
            ``amp8.nn.gemm_precision.decode_gemm_precision``); the message names ``key``.
    """
    granularity, high, split = decode_gemm_precision(key, saved)
    reason = None
    if saved_under is not None and saved_under != recipe_record(recipe):
        reason = f"it was made under another recipe ({saved_under})"
    else:
        try:
            return recipe.for_gemms(granularity, high, split)
        except ValueError as error:
            reason = f"this layer's recipe cannot take it ({error})"
    warnings.warn(
        f"amp8: {key} ({granularity.value} GEMMs, high precision {high}) is not loaded: {reason}; the "
        f"GEMMs run as this layer's recipe says ({recipe_record(recipe)})",
        stacklevel=5,  # the caller of the layer's load, as from the layer's own code
    )
    return None
