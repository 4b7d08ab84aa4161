"""The two forms of an amp8 model's ``state_dict``: how a layer with stored weights
writes them and reads them back.

- **Plain** (the default): what the model held before ``amp8.initialize``. Each FP8
  layer's weight is its real values (the stored values, dequantized) in the dtype the
  weight reports, and none of amp8's buffers (scales, amax histories, GEMM precision) is
  in it. It loads into the plain model class: ``load_state_dict`` (strict), Hugging Face
  ``from_pretrained``, safetensors. Loaded back into an amp8 model, each weight is
  stored again from those values (within one rounding of the stored ones), and amp8's
  buffers stay as the model has them.
- **Compact** (inside ``amp8.compact_state_dict(model)``): what amp8 holds. Each weight
  as stored (FP16 or FP8, one or two bytes per element) with its scales, and amp8's
  buffers, and the layer's recipe in its checkpoint metadata (``recipe_record``); loaded
  into an amp8 model it restores the run bit for bit. It holds plain tensors too
  (safetensors takes FP8 dtypes), but a plain model cannot use them.

A layer whose weights FSDP2 shards (O3 in a process group) always gives the compact form:
each rank holds only its rows, as stored. The switch between the forms,
``compact_state_dict``, is in ``amp8.nn.stored_weights`` beside the layers' flag it sets.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
from torch import nn

from amp8.config.recipe import Recipe
from amp8.quant.checks import check_loaded_scales
from amp8.quant.codec import Layout
from amp8.tensor.scaled_weight import ScaledWeight
from amp8.tensor.stored import PLAIN_LOAD_MARK, StoredWeight

RECIPE_METADATA = "amp8_recipe"
"""The key of a layer's recipe in its checkpoint metadata (``state_dict()._metadata``)."""


class LayerWithForms(Protocol):
    """What the forms read of a layer (an ``amp8.nn.stored_weights.StoredWeightsBase``)."""

    compact_state_dict: bool
    _buffers: dict[str, torch.Tensor | None]

    def stored_weights(self) -> tuple[StoredWeight, ...]:
        """The handles of the layer's stored weights."""
        ...


def recipe_record(recipe: Recipe) -> dict[str, Any]:
    """What a checkpoint records of ``recipe``: what the layer's scales and GEMM
    precision were made under (strings and ints, which ``torch.load(weights_only=True)``
    reads)."""
    return {"granularity": recipe.granularity.value, "microscaling": recipe.microscaling.value,
            "block_size": recipe.block_size}


def saved_recipe(local_metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``recipe_record`` in a layer's checkpoint metadata, or None (a checkpoint of
    an older amp8, or a state dict that lost its metadata).

    Raises:
        ValueError: a record that is not one ``recipe_record`` writes.
    """
    record = (local_metadata or {}).get(RECIPE_METADATA)
    if record is None:
        return None
    if not isinstance(record, dict) or set(record) != {"granularity", "microscaling", "block_size"} or not (
        isinstance(record["block_size"], int) and record["block_size"] > 0
    ):
        raise ValueError(
            f"checkpoint metadata {RECIPE_METADATA}={record!r} is not an amp8 recipe record: expected "
            "granularity, microscaling and a block_size > 0; the checkpoint is corrupt or not from amp8"
        )
    return record


def _own_memory(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it is a view into a larger storage."""
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def apply_state_dict_form(
    module: LayerWithForms, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """``state_dict`` post-hook of a layer with stored weights: the plain form (each
    stored weight's real values in the dtype it reports, none of amp8's buffers) or,
    under ``compact_state_dict`` or where FSDP2 shards a weight, the compact form (each
    weight as stored, with its scales and amp8's buffers, and the layer's recipe in its
    checkpoint metadata)."""
    handles = module.stored_weights()
    compact = module.compact_state_dict or any(handle.sharded for handle in handles)
    if compact:
        local_metadata[RECIPE_METADATA] = recipe_record(handles[0].recipe)
    for handle in handles:
        key = prefix + handle.name
        if key not in state_dict or not isinstance(handle.param, ScaledWeight):
            continue
        if not compact and state_dict[key] is handle.param:
            continue  # ``keep_vars=True``: the Parameter itself, which reads as the real weight
        if compact:
            # A weight or scales kept in an optimizer's flat buffers (amp8.optim.update_groups)
            # get memory of their own: a checkpoint then holds this layer's alone, and
            # safetensors refuses tensors that share memory.
            state_dict[key] = _own_memory(handle.data.detach())
            scale_key = prefix + handle.scale_name
            if scale_key in state_dict:
                state_dict[scale_key] = _own_memory(state_dict[scale_key])
        else:
            state_dict[key] = handle.read().to(handle.param.dtype)
    if not compact:
        for name in [*module._buffers, *(handle.scale_name for handle in handles)]:
            state_dict.pop(prefix + name, None)


def load_stored_weight(
    module: nn.Module, handle: StoredWeight, saved: torch.Tensor, saved_scale: torch.Tensor | None, block_size: int,
    key: str, error_msgs: list[str],
) -> None:
    """Store the checkpoint's ``saved`` weight in ``handle``, a stored weight of
    ``module``: as saved (bit for bit) from the compact form at the layer's storage;
    re-encoded from the plain form's real values (``saved_scale`` None); converted, with
    a warning, from the compact form of another storage (another opt level, another
    recipe's scales). ``block_size``: that of the saved scales. A wrong shape goes to
    ``error_msgs``, as torch reports it."""
    param, stored_scale = handle.param, handle.stored_scale
    if tuple(saved.shape) != tuple(param.shape):
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {tuple(saved.shape)} from checkpoint, "
            f"the shape in current model is {tuple(param.shape)}."
        )
        return
    if saved_scale is None:
        handle.write(saved.to(param.device, torch.float32))
        module.__dict__[PLAIN_LOAD_MARK] = True  # read by amp8.optim.layer_state (what the plain form lacks)
        handle.note_plain_load()
        return
    scale_key = key[: -len(handle.name)] + handle.scale_name
    check_loaded_scales(scale_key, saved_scale)
    if saved.dtype == handle.dtype and saved_scale.shape == stored_scale.shape and (
        saved_scale.dtype == stored_scale.dtype
    ):
        handle.store(saved.to(param.device), saved_scale.to(param.device))
        return
    saved_scale = saved_scale.to(saved.device)
    real = Layout.of_saved(saved, saved_scale, block_size).decode(saved, saved_scale)
    handle.write(real.to(param.device))
    warnings.warn(
        f"amp8: converted {key} from {saved.dtype} to {handle.dtype} storage "
        f"(scales of shape {tuple(saved_scale.shape)}, blocks of {block_size}, to "
        f"{tuple(handle.stored_scale.shape)})",
        stacklevel=4,
    )
