"""``StoredWeightsBase``: the part of an amp8 layer that stores its weights, one or more.

A layer whose weights amp8 stores scaled (``Fp8Linear``, ``LowBitEmbedding``, and
``Fp8Experts`` with two) holds the caller's weight Parameters with ``w * scale`` in them
and one ``amp8.tensor.StoredWeight`` handle per weight, which the optimizer, clipping and
the gradient reduction go through. ``StoredWeightsBase`` keeps that storage through
``.to()``, copies and both forms of a checkpoint (``amp8.nn.state_dict_form``);
``compact_state_dict`` switches a model's layers to the compact form. A layer with one
``weight`` builds on ``amp8.nn.single_weight.SingleStoredWeightModule``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.nn.state_dict_form import apply_state_dict_form, load_stored_weight, saved_recipe
from amp8.quant.checks import check_loaded_scales
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.scaled_weight import ScaledWeight, retarget
from amp8.tensor.stored import StoredWeight
from amp8.tensor.weight_grad import WeightGrad


class StoredWeightsBase(nn.Module):
    """Base of the modules whose weights amp8 stores scaled (one ``StoredWeight`` per
    weight Parameter, ``stored_weights()``): keeps amp8's dtypes through ``.to()``,
    copies and checkpoints, and re-encodes a weight saved at another storage on load.

    Each weight Parameter ``name`` has scales ``{name}_scale`` (an attribute that reads
    the handle's, saved in the compact ``state_dict``; no buffer, so that tools that copy
    buffers leave them with their weight): ``name.data == w * scale`` (a scalar for FP16
    storage; for FP8 storage the weight's scales at the recipe's granularity).
    """

    compact_state_dict = False
    """Whether ``state_dict()`` gives the compact form (see ``amp8.nn.state_dict_form``);
    set inside ``amp8.compact_state_dict(model)``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(apply_state_dict_form)

    def stored_weights(self) -> tuple[StoredWeight, ...]:
        """The handles of this module's stored weights."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        """``{name}_scale``: the scales of stored weight ``name`` (see the class docstring);
        else what ``nn.Module`` finds."""
        if name.endswith("_scale"):
            try:
                handles = self.stored_weights()
            except AttributeError:  # inside __init__, before the handles exist
                handles = ()
            for handle in handles:
                if handle.scale_name == name:
                    return handle.stored_scale
        return super().__getattr__(name)

    def _add_stored_weight(
        self, name: str, weight: nn.Parameter, recipe: Recipe, storage: Precision, *, fixed_storage: bool = False,
    ) -> StoredWeight:
        """Take over ``weight`` as Parameter ``name`` and store its values at ``storage``
        (see ``StoredWeight`` for ``fixed_storage``); its handle holds the scales."""
        setattr(self, name, weight)
        # The handle stores the values and makes ``weight`` a ``ScaledWeight`` (see amp8.tensor.scaled_weight).
        return StoredWeight(self, recipe, storage, fixed_storage=fixed_storage, name=name)

    def drop_weight_cache(self) -> None:
        """Forget anything derived from the stored weights (nothing here; ``Fp8Linear``
        caches its FP8 casts)."""

    def _after_move(self) -> None:
        """Re-bind what refers to buffers that ``.to()``, a copy or a load replaced."""

    _GRAD_ROUTES: tuple[str, ...] = ()
    """The attributes ``_build_grad_routes`` sets: not copied, built again."""

    def _build_grad_routes(self) -> None:
        """Build what takes the weight gradients out of backward where the Parameters
        cannot (grad sinks of sharded weights; see ``amp8.nn.grad_routes``): after a copy,
        a change of storage and ``mark_weights_sharded``. Nothing here."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._GRAD_ROUTES:  # tensors with hooks: rebuilt in __setstate__
            state.pop(name, None)
        return state

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """torch's, plus each stored weight's scales (``{name}_scale``); the plain form
        drops them again (``apply_state_dict_form``)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for handle in self.stored_weights():
            scale = handle.stored_scale
            destination[prefix + handle.scale_name] = scale if keep_vars else scale.detach()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for handle in self.stored_weights():  # copied handles hold no layer, copied Parameters no mark
            handle.bind(self)
        self._refresh_storage()
        self._after_move()
        self._build_grad_routes()

    @property
    def weight_storage(self) -> Precision:
        """How the weights are stored: ``Precision.FP16``, ``Precision.FP8`` or ``AS_IS``."""
        return self.stored_weights()[0].storage

    def _refresh_grad_routes(self) -> None:
        """Rebuild the grad routes where they no longer fit the weights (here: always)."""
        self._build_grad_routes()

    def set_weight_storage(self, weight_storage: Precision) -> None:
        """Re-store the weights as FP16 or FP8 (O3 keeps FP8 weights beside FP16 masters)."""
        for handle in self.stored_weights():
            handle.restore(weight_storage)
        self._refresh_grad_routes()

    def mark_weights_sharded(self) -> None:
        """FSDP2 put new weight Parameters in place that hold this rank's rows (see
        ``amp8.distributed.fsdp``): the gradients stay on the handles from now on (see
        ``StoredWeight.shard``)."""
        for handle in self.stored_weights():
            handle.shard(handle.param)
        self._build_grad_routes()

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        """Load either form of ``state_dict`` (see ``compact_state_dict``): the stored
        weights through ``amp8.nn.state_dict_form.load_stored_weight`` (``local_metadata``
        names the recipe the saved scales were made with), amp8's buffers from a compact
        checkpoint or kept as they are for a plain one."""
        saved = saved_recipe(local_metadata)
        for handle in self.stored_weights():
            key, scale_key = prefix + handle.name, prefix + handle.scale_name
            if not isinstance(handle.param, ScaledWeight):
                # AS_IS and sharded weights load as torch loads any Parameter; a sharded
                # weight's scales are the whole weight's, as saved.
                saved_scale = state_dict.pop(scale_key, None)
                if handle.sharded and saved_scale is not None:
                    check_loaded_scales(scale_key, saved_scale)
                    handle.stored_scale.copy_(saved_scale)
                continue
            block_size = handle.recipe.block_size if saved is None else saved["block_size"]
            weight, saved_scale = state_dict.pop(key, None), state_dict.pop(scale_key, None)
            if weight is None:
                missing_keys.append(key)
            else:
                load_stored_weight(self, handle, weight, saved_scale, block_size, key, error_msgs)
        for name, buffer in self._buffers.items():  # a plain checkpoint has none of amp8's buffers
            if buffer is not None and name not in self._non_persistent_buffers_set:
                state_dict.setdefault(prefix + name, buffer.clone())
        self.drop_weight_cache()
        with self._scaled_weights_set_aside():
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        self._refresh_storage()
        self._after_move()

    @contextlib.contextmanager
    def _scaled_weights_set_aside(self) -> Iterator[None]:
        """Inside the block the ``ScaledWeight`` Parameters are out of ``_parameters`` (the
        caller loads or moves them itself; torch's own code would replace them), then back
        in their places, beside whatever the block left of the others."""
        order = list(self._parameters)
        aside = {name: param for name, param in self._parameters.items() if isinstance(param, ScaledWeight)}
        for name in aside:
            del self._parameters[name]
        try:
            yield
        finally:
            others = dict(self._parameters)
            self._parameters.clear()
            self._parameters.update((name, aside.get(name, others.get(name))) for name in order)

    def _refresh_storage(self) -> None:
        """Point each stored weight at the scale buffer the layer holds now."""
        for handle in self.stored_weights():
            handle.refresh()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "StoredWeightsBase":
        """``.to()``, ``.cuda()``, ``.half()`` and friends: move amp8's tensors to the new
        device, keeping their dtypes (a float32 scale of 2**17 would be inf in FP16); a
        stored weight keeps its storage and reports the dtype ``fn`` gives."""
        self.drop_weight_cache()
        kept = {name: (buffer, buffer.dtype) for name, buffer in self._buffers.items() if buffer is not None}
        with self._scaled_weights_set_aside():
            super()._apply(fn, recurse)
        for name, (original, dtype) in kept.items():
            buffer = self._buffers[name]
            if buffer is not None and buffer.dtype != dtype:
                self._buffers[name] = original.to(buffer.device)
        for handle in self.stored_weights():
            scale = handle.stored_scale.to(_device_after(fn, handle.stored_scale))
            if isinstance(handle.param, ScaledWeight):
                _apply_to_weight(handle, fn, scale)
            handle.set_stored_scale(scale)
        self._after_apply()
        self._after_move()
        return self

    def _after_apply(self) -> None:
        """What ``_apply`` does last, before ``_after_move``."""


def _device_after(fn: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.device:
    """The device ``fn`` (a ``.to()``) moves ``tensor`` to, without moving it."""
    return fn(torch.empty((), dtype=tensor.dtype, device=tensor.device)).device


def _apply_to_weight(handle: StoredWeight, fn: Callable[[torch.Tensor], torch.Tensor], scale: torch.Tensor) -> None:
    """``fn`` (a ``.to()``) on ``handle``'s ``ScaledWeight``: its storage moves, keeping
    its dtype, and it reports the dtype ``fn`` gives a tensor of its reported dtype; its
    gradient moves with it."""
    param = handle.param
    reported = fn(torch.empty((), dtype=param.dtype, device=param.device)).dtype
    data = fn(param._data)
    if data.dtype != param._data.dtype:
        data = param._data.to(data.device)
    grad, param.grad = param.grad, None
    if retarget(param, data, scale, reported):
        handle.mark(param, again=True)
    if isinstance(grad, WeightGrad):
        fp8 = grad.fp8
        param.grad = WeightGrad(
            ScaledTensor(fp8.data.to(data.device), fp8.scale.to(data.device), fp8.block_size), reported, grad.grad_layout
        )
    elif grad is not None:
        param.grad = fn(grad)


@contextlib.contextmanager
def compact_state_dict(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model.state_dict()`` (and everything that calls it: ``torch.save``
    of it, a trainer's checkpoints) gives the compact form: the stored weights with their
    scales and amp8's buffers, which resume bit for bit. Outside, the plain form (see
    ``amp8.nn.state_dict_form``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp8.compact_state_dict takes the model (an nn.Module), got {type(model).__name__}")
    layers = [module for module in model.modules() if isinstance(module, StoredWeightsBase)]
    before = [layer.__dict__.get("compact_state_dict") for layer in layers]
    for layer in layers:
        layer.compact_state_dict = True
    try:
        yield model
    finally:
        for layer, value in zip(layers, before):
            if value is None:
                layer.__dict__.pop("compact_state_dict", None)
            else:
                layer.compact_state_dict = value
