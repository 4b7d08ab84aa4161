"""The FP8 layers' own state, carried in ``LowBitAdam.state_dict()``.

A model's plain ``state_dict`` (the default form, ``amp8.nn.state_dict_form``) holds each
FP8 layer's real weight and none of amp8's buffers: the amax histories of delayed scaling,
the GEMM precision ``amp8.Controller`` gives each layer, and the weight's exact scales.
Most resumes load the plain model state and the optimizer state, so the optimizer's
state dict carries those for every FP8 layer whose weight it trains, keyed by the
parameter's index as torch keys ``state``, as tensors only (``torch.load(weights_only=True)``
reads them). On ``load_state_dict`` each layer takes them back through its own compact
load (``module.load_state_dict``), with its weight re-encoded under the saved scales from
the real values the model holds: the plain form's real values are the stored ones
dequantized, so that gives the stored weight bit for bit.

A layer loaded from a plain state dict with no optimizer state after it keeps amp8's
buffers as the model had them; the layer marks itself on such a load, and ``LowBitAdam.step``
warns once (``lost_after_plain_load``) naming what was not restored.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe_fields import Scaling
from amp8.tensor.scaled_weight import ScaledWeight
from amp8.tensor.stored import PLAIN_LOAD_MARK, StoredWeight

LAYERS_KEY = "layers"
"""The key, inside the ``"amp8"`` entry of the optimizer's state dict, of the layers' state."""
_BUFFERS, _WEIGHT_SCALE, _STORED_AS = "buffers", "weight_scale", "stored_as"
_RESTORED = "_amp8_layer_state_restored"  # set by ``restore_layer_states``: a later plain load keeps its buffers


def _module(handle: StoredWeight) -> nn.Module:
    return handle._module  # the layer that owns the weight (a weak reference inside the handle)


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` would hold, by their keys in it."""
    buffers = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buffer
    return buffers


def _saved_handles(
    weights: dict[nn.Parameter, StoredWeight], index_of: dict[nn.Parameter, int]
) -> list[tuple[int, StoredWeight]]:
    """``(index, handle)`` of each FP8 weight whose layer state the optimizer carries: not
    sharded over ranks (a sharded layer's state dict is always the compact form)."""
    return sorted(
        ((index_of[param], handle) for param, handle in weights.items() if param in index_of and not handle.sharded),
        key=lambda entry: entry[0],
    )


def layer_states(
    weights: dict[nn.Parameter, StoredWeight], index_of: dict[nn.Parameter, int]
) -> dict[int, dict[str, Any]]:
    """The FP8 layers' state by parameter index: each weight's scales, and the layer's
    buffers (under its first weight's index), copied."""
    saved: dict[int, dict[str, Any]] = {}
    seen: set[int] = set()
    for index, handle in _saved_handles(weights, index_of):
        module = _module(handle)
        entry: dict[str, Any] = {
            _WEIGHT_SCALE: handle.stored_scale.detach().clone(), _STORED_AS: _stored_as(handle),
        }
        if id(module) not in seen:
            seen.add(id(module))
            scale_names = {h.scale_name for h in module.stored_weights()}
            entry[_BUFFERS] = {
                key: buffer.detach().clone()
                for key, buffer in _persistent_buffers(module).items() if key not in scale_names
            }
        saved[index] = entry
    return saved


def _stored_as(handle: StoredWeight) -> str:
    """How the weight is stored and under which recipe: a layer takes saved state only
    from the same (a checkpoint of another level or recipe is converted by the model's
    compact load, not here)."""
    return f"{handle.storage.value} {handle.recipe!r}"


def _encoded(handle: StoredWeight, scale: torch.Tensor) -> torch.Tensor:
    """The weight as stored under ``scale``, from the real values it holds now: the stored
    data itself where its scales are ``scale`` already, else re-encoded (round to nearest;
    real values that were stored under ``scale`` and dequantized come back exactly)."""
    current = handle.stored_scale
    if current.shape == scale.shape and current.dtype == scale.dtype and torch.equal(current, scale):
        return handle.data.detach().clone()
    return handle.encode(handle.read(), scale=scale.float())[0]


def restore_layer_states(
    weights: dict[nn.Parameter, StoredWeight], params: list[nn.Parameter], saved: dict[Any, dict[str, Any]]
) -> None:
    """Give each FP8 layer the state ``layer_states`` saved (``params``: the optimizer's
    parameters in index order), through the layer's own compact load; a layer stored at
    another level or under another recipe than saved keeps its own (with a warning after a
    plain model load, which converted nothing).

    Raises:
        ValueError: a saved index names no FP8 weight of this optimizer (the checkpoint is
            of another model, or of another parameter order).
        RuntimeError: the layer refuses the saved state (a shape, or a scale that is not
            finite and positive).
    """
    by_module: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
    skipped: list[int] = []
    for raw_index, entry in sorted(saved.items(), key=lambda item: int(item[0])):
        index = int(raw_index)
        handle = weights.get(params[index]) if 0 <= index < len(params) else None
        if handle is None:
            raise ValueError(
                f"the optimizer checkpoint holds FP8 layer state for parameter {index}, which is not an "
                "FP8 layer's weight in this optimizer: load a checkpoint of the same model, built "
                "by the same amp8.initialize call, with the parameters in the same order"
            )
        if handle.sharded:
            continue
        if entry.get(_STORED_AS) != _stored_as(handle):
            if _module(handle).__dict__.get(PLAIN_LOAD_MARK):  # (after a compact load the model converted them)
                skipped.append(index)
            continue
        module = _module(handle)
        _, target = by_module.setdefault(id(module), (module, {}))
        device = handle.data.device
        target.update({key: value.to(device) for key, value in entry.get(_BUFFERS, {}).items()})
        scale = entry[_WEIGHT_SCALE].to(device)
        target[handle.scale_name] = scale
        if isinstance(handle.param, ScaledWeight):
            target[handle.name] = _encoded(handle, scale.to(handle.stored_scale.dtype))
    for module, target in by_module.values():
        result = module.load_state_dict(target, strict=False)
        if result.unexpected_keys:
            raise RuntimeError(
                f"amp8: an FP8 layer ({type(module).__name__}) has no {result.unexpected_keys} that the "
                "optimizer checkpoint holds for it: load a checkpoint saved by the same amp8 setup"
            )
        module.__dict__.pop(PLAIN_LOAD_MARK, None)
        module.__dict__[_RESTORED] = True
    if skipped:
        warnings.warn(
            f"amp8: the optimizer checkpoint's FP8 layer state for parameters {skipped} was saved at "
            "another opt level or under another recipe and is not taken (those layers keep their amax "
            "histories, GEMM precision and weight scales as they are); to carry them over, save and load "
            "the model inside amp8.compact_state_dict(model), which converts them",
            stacklevel=3,
        )


def fp8_layers(weights: Iterable[StoredWeight]) -> list[nn.Module]:
    """The layers of ``weights`` whose state the optimizer carries, each once."""
    modules: dict[int, nn.Module] = {}
    for handle in weights:
        if handle.storage is not Precision.AS_IS and not handle.sharded:
            module = _module(handle)
            modules.setdefault(id(module), module)
    return list(modules.values())


def lost_after_plain_load(modules: list[nn.Module], controller_attached: bool) -> str | None:
    """The warning for layers loaded from a plain state dict with no optimizer state after
    it, where that loses something (None where it loses nothing); the marks are cleared."""
    loaded = [module for module in modules if module.__dict__.pop(PLAIN_LOAD_MARK, False)]
    if not loaded:
        return None
    handles = [h for module in loaded for h in module.stored_weights()]  # type: ignore[operator]
    # A plain load keeps the buffers as they are: as the optimizer's load restored them, if it came first.
    unrestored = [h for module in loaded if not module.__dict__.get(_RESTORED) for h in module.stored_weights()]
    lost = []
    if any(h.recipe.scaling is Scaling.DELAYED for h in unrestored):
        lost.append("the amax histories of delayed scaling")
    if controller_attached and unrestored:
        lost.append("the GEMM precision amp8.Controller gave each layer")
    if any(h.storage is Precision.FP8 and not h.recipe.power_of_2_scales for h in handles):
        lost.append("the exact scales of the FP8 weights (a recipe without power-of-two scales)")
    if not lost:
        return None
    return (
        f"amp8: {len(loaded)} FP8 layer(s) were loaded from a plain model state_dict and no optimizer "
        f"state was loaded after it, so {', '.join(lost)} are as this model had them, not as saved. "
        "To resume bit for bit, load the optimizer.state_dict() saved with the model after the model's "
        "(the optimizer carries the layers' state), or save the model inside amp8.compact_state_dict(model)"
    )
