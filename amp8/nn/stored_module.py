"""``StoredWeightModule``: the part of an amp8 layer that stores its weight.

A layer whose weight amp8 stores scaled (``Fp8Linear``, ``LowBitEmbedding``) holds the
caller's ``weight`` Parameter with ``w * weight_scale`` in it, the ``weight_scale``
buffer, and an ``amp8.tensor.StoredWeight`` handle that the optimizer, clipping and the
gradient reduction go through. ``StoredWeightsModule``, its base, is what any module
with stored weights shares (``Fp8Experts`` stores two). Backward returns each new FP8 weight gradient, a
``WeightGrad``, to autograd as the gradient of the ``weight`` Parameter itself, or of a
stand-in where the Parameter cannot take it (see ``_grad_target``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Callable, NoReturn

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.quant.checks import check_loaded_scales
from amp8.tensor.scaled import ScaledTensor, is_sharded
from amp8.tensor.scaled_weight import ScaledWeight, retarget
from amp8.tensor.stored import PLAIN_LOAD_MARK, StoredWeight, requiring_grad, stored_weight
from amp8.tensor.weight_grad import WeightGrad, WeightGradInFlight


class StoredWeightsModule(nn.Module):
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
        self.register_state_dict_post_hook(_state_dict_form)

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
        cannot (grad sinks of sharded weights; see ``grad_sink``): after a copy, a
        change of storage and ``mark_weights_sharded``. Nothing here."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._GRAD_ROUTES:  # tensors with hooks: rebuilt in __setstate__
            state.pop(name, None)
        return state

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """torch's, plus each stored weight's scales (``{name}_scale``); the plain form
        drops them again (``_state_dict_form``)."""
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

    def _load_stored_weight(
        self, handle: StoredWeight, saved: torch.Tensor, saved_scale: torch.Tensor | None, block_size: int, key: str,
        error_msgs: list[str],
    ) -> None:
        """Store the checkpoint's ``saved`` weight in ``handle``: as saved (bit for bit)
        from the compact form at this layer's storage; re-encoded from the plain form's
        real values (``saved_scale`` None); converted, with a warning, from the compact
        form of another storage (another opt level, another recipe's scales).
        ``block_size``: that of the saved scales."""
        param, stored_scale = handle.param, handle.stored_scale
        if tuple(saved.shape) != tuple(param.shape):
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(saved.shape)} from checkpoint, "
                f"the shape in current model is {tuple(param.shape)}."
            )
            return
        if saved_scale is None:
            handle.write(saved.to(param.device, torch.float32))
            self.__dict__[PLAIN_LOAD_MARK] = True  # read by amp8.optim.layer_state (what the plain form lacks)
            handle.note_plain_load()
            return
        scale_key = key[: -len(handle.name)] + handle.scale_name
        check_loaded_scales(scale_key, saved_scale)
        if saved.dtype == handle.dtype and saved_scale.shape == stored_scale.shape and (
            saved_scale.dtype == stored_scale.dtype
        ):
            handle.store(saved.to(param.device), saved_scale.to(param.device))
            return
        real = ScaledTensor(saved, saved_scale.to(saved.device), block_size).dequantize()
        handle.write(real.to(param.device))
        warnings.warn(
            f"amp8: converted {key} from {saved.dtype} to {handle.dtype} storage "
            f"(scales of shape {tuple(saved_scale.shape)}, blocks of {block_size}, to "
            f"{tuple(handle.stored_scale.shape)})",
            stacklevel=4,
        )

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        """Load either form of ``state_dict`` (see ``compact_state_dict``): the stored
        weights through ``_load_stored_weight`` (``local_metadata`` names the recipe the
        saved scales were made with), amp8's buffers from a compact checkpoint or kept as
        they are for a plain one."""
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
                self._load_stored_weight(handle, weight, saved_scale, block_size, key, error_msgs)
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

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "StoredWeightsModule":
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
            scale = handle.stored_scale.to(self._device_after(fn, handle.stored_scale))
            if isinstance(handle.param, ScaledWeight):
                _apply_to_weight(handle, fn, scale)
            handle.set_stored_scale(scale)
        self._after_apply()
        self._after_move()
        return self

    def _after_apply(self) -> None:
        """What ``_apply`` does last, before ``_after_move``."""

    @staticmethod
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


def grad_sink(handle: StoredWeight) -> torch.Tensor:
    """A zero ``WeightGradInFlight`` leaf of ``handle``'s weight shape (FSDP2's sharded
    Parameter reports the whole shape) that takes the weight's gradient from backward in
    place of the Parameter, and hands it to ``handle.add_grad``: a weight FSDP2 shards
    must not get a ``.grad``, which FSDP2 would reduce in its own dtype."""
    weight = handle.param
    sink = WeightGradInFlight.zeros(tuple(weight.shape), handle.grad_layout, weight.dtype, weight.device)
    sink.requires_grad_(True)
    sink.register_post_accumulate_grad_hook(functools.partial(_take_sink_grad, weakref.ref(handle)))
    return sink


def _take_sink_grad(handle: "weakref.ref[StoredWeight]", sink: torch.Tensor) -> None:
    grad, sink.grad = sink.grad, None
    stored = handle()
    if stored is not None:
        stored.add_grad(grad)  # type: ignore[arg-type]


class StoredWeightModule(StoredWeightsModule):
    """Base of the modules with one stored ``weight`` (``Fp8Linear``,
    ``LowBitEmbedding``): builds the storage in ``_init_storage`` and routes the weight
    gradient out of backward (see ``_grad_target``).

    Buffers (saved in ``state_dict``):
        weight_scale: float32, ``weight.data == w * weight_scale`` (a scalar for FP16
            storage; for FP8 storage the weight's scales at the recipe's granularity).
    """

    weight: nn.Parameter
    weight_scale: torch.Tensor
    stored_weight: StoredWeight

    def _init_storage(
        self, weight: nn.Parameter, recipe: Recipe, storage: Precision, *, fixed_storage: bool = False
    ) -> None:
        """Take over ``weight`` and store its values at ``storage`` (see ``StoredWeight``
        for ``fixed_storage``). Call once, from ``__init__``, after ``nn.Module.__init__``."""
        self.stored_weight = self._add_stored_weight("weight", weight, recipe, storage, fixed_storage=fixed_storage)
        self._build_grad_routes()

    def stored_weights(self) -> tuple[StoredWeight, ...]:
        """The handle of ``weight``."""
        return (self.stored_weight,)

    # -- the weight gradient's way out of backward -------------------------------------
    def _grad_target(self) -> torch.Tensor | None:
        """The tensor whose gradient backward returns the weight gradient as; None where
        the weight needs none (its ``requires_grad`` is off).

        The Parameter itself where it can take a ``WeightGrad`` (eager code), so that the
        gradient lands in ``weight.grad`` through autograd, hooks included. In a compiled
        graph, the gradient bridge: the graph must not read the Parameter's ``.grad``
        (Dynamo cannot fakeify a traceable subclass as a plain Parameter's gradient), and
        the bridge's backward, run eagerly, hands the gradient on to the Parameter. For a
        weight FSDP2 shards, the grad sink, whose hook hands it to the handle (FSDP2
        would reduce a ``.grad`` with its own collectives).
        """
        weight = self.weight
        if not weight.requires_grad:
            return None
        if self.weight_storage is Precision.AS_IS:
            return weight
        if self.stored_weight.sharded:
            return self._grad_sink
        return self._grad_bridge if torch.compiler.is_compiling() else weight

    _GRAD_ROUTES = ("_grad_sink", "_grad_bridge", "_grad_routes_for")

    def _build_grad_routes(self) -> None:
        """Build the grad sink and the gradient bridge (see ``_grad_target``) for the
        weight's dtype and device now; outside compiled code, as these are leaves and
        autograd nodes that a compiled graph takes as inputs."""
        handle = self.stored_weight
        self._grad_routes_for = self._grad_routes_key()
        if handle.storage is Precision.AS_IS:
            self._grad_sink = self._grad_bridge = None
            return
        self._grad_sink = grad_sink(handle)
        self._grad_bridge = None if handle.sharded else _bridge(self.weight, tuple(self.weight.shape), handle.grad_layout)

    def _grad_routes_key(self) -> tuple[Any, ...]:
        """What the grad routes are built for: the weight's dtype and device, whether it
        is sharded and, if not, the Parameter (its id: the bridge keeps it alive, so the
        id is not reused while the routes are; FSDP2 swaps in another each forward)."""
        weight, sharded = self.weight, self.stored_weight.sharded
        return weight.dtype, weight.device, sharded, None if sharded else id(weight)

    def _refresh_grad_routes(self) -> None:
        """Rebuild the grad routes where what they were built for changed (see
        ``_grad_routes_key``); from eager code only."""
        if getattr(self, "_grad_routes_for", None) != self._grad_routes_key():
            self._build_grad_routes()

    def narrow_weight(self, dim: int, start: int, length: int) -> None:
        """Keep only ``length`` rows (``dim=0``) or columns (``dim=1``) of the stored
        weight from ``start``, at the same scale, in a new ``weight`` Parameter (autograd
        keeps a Parameter's shape): one rank's shard under tensor parallelism (see
        ``amp8.distributed.tensor_parallel``). Build the optimizer afterwards."""
        old, handle = self.weight, self.stored_weight
        if isinstance(old, ScaledWeight):
            data = handle.data.narrow(dim, start, length).clone()
            self.weight = nn.Parameter(
                ScaledWeight(data, old._scale, old.block_size, old.dtype, handle.write), requires_grad=old.requires_grad
            )
            handle.mark(self.weight)
        else:
            self.weight = nn.Parameter(old.detach().narrow(dim, start, length).clone(), requires_grad=old.requires_grad)
        self.drop_weight_cache()
        self._build_grad_routes()

    def _after_apply(self) -> None:
        self._refresh_grad_routes()

    # -- weight storage (see ``amp8.tensor.StoredWeight``) ------------------------------------
    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weight is stored in (float16 or float8_e4m3fn)."""
        return self.stored_weight.dtype

    @property
    def block_size(self) -> int:
        """Elements per block edge of this layer's scales (0 unless the recipe is "block")."""
        return self.stored_weight.block_size

    def read_weight(self) -> torch.Tensor:
        """The weight's real values in float32 (this rank's rows, outside forward and
        backward, when FSDP2 shards the weight: see ``amp8.distributed.fsdp``)."""
        return self.stored_weight.read()

    def write_weight(self, real_weight: torch.Tensor, noise_key: torch.Tensor | int | None = None) -> None:
        """Store ``real_weight`` (any float dtype) into the weight Parameter, in place,
        rounded stochastically under ``noise_key`` when one is given."""
        self.stored_weight.write(real_weight, noise_key)

    @property
    def weight_grad(self) -> ScaledTensor | None:
        """The weight gradient as FP8 + scales, or None: the FP8 tensors inside
        ``weight.grad`` (see ``amp8.tensor.StoredWeight.grad``). Assign None to clear it, or a
        ``ScaledTensor`` of the gradient's dtype, shape and scale layout to replace it."""
        return self.stored_weight.grad()

    @weight_grad.setter
    def weight_grad(self, value: ScaledTensor | None) -> None:
        self.stored_weight.set_grad(value)

    def _plain_weight(self) -> torch.Tensor | None:
        """The plain tensor that torch code put in place of the weight for this call
        (``torch.func.functional_call``, ``stack_module_state`` under ``vmap``), which the
        layer then computes with as torch's own layer would, in that tensor's dtype; None
        where the weight is amp8's. Refuses what amp8 did not place and cannot serve (see
        ``_refuse_replaced_weight``)."""
        handle = self.stored_weight
        if handle.sharded or handle.storage is Precision.AS_IS:
            return None
        weight = self.weight
        if stored_weight(weight) is handle:
            return None
        if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter) and not is_sharded(weight) and (
            stored_weight(weight) is None and not torch.nn.utils.parametrize.is_parametrized(self, "weight")
        ):
            return weight
        self._refuse_replaced_weight()

    def _refuse_replaced_weight(self) -> NoReturn:
        """Raise for a weight that is neither amp8's nor a plain tensor for this call,
        naming what to do instead."""
        layer = type(self).__name__
        if torch.nn.utils.parametrize.is_parametrized(self, "weight"):
            raise TypeError(
                f"the weight of an amp8 {layer} was parametrized after amp8.initialize; register "
                "parametrizations (weight_norm, spectral_norm, orthogonal, ...) before amp8.initialize: amp8 "
                "then keeps that layer as torch's, computing the weight in high precision each forward (or "
                "remove it with torch.nn.utils.parametrize.remove_parametrizations)"
            )
        weight = self.weight
        if stored_weight(weight) is not None:
            raise TypeError(
                f"the weight of an amp8 {layer} was tied to another FP8 layer's weight after "
                "amp8.initialize; tie weights before amp8.initialize (amp8 then keeps the layers that share "
                "a weight in high precision, so that both read the same values)"
            )
        raise RuntimeError(
            f"the weight of an amp8 {layer} was replaced after amp8.initialize (by assigning a new Parameter, "
            "which the optimizer does not hold, or by fully_shard or a stock tensor-parallel style). To give the "
            "layer new values, write them into its weight: layer.weight.copy_(t), layer.weight.data = t, or "
            "model.load_state_dict. For tensor parallelism use amp8.distributed.Fp8ColwiseParallel and "
            "Fp8RowwiseParallel; for FSDP2 use opt_level='O3' in a process group, where amp8 applies fully_shard "
            "itself, or DistributedDataParallel at O1/O2, wrapped after amp8.initialize and registered with "
            "amp8.distributed.register_ddp"
        )


class _GradBridge(torch.autograd.Function):
    """``apply(weight, sink)``: a stand-in for ``weight`` (``sink``, an empty
    ``WeightGradInFlight``) whose gradient backward passes on to ``weight`` as a
    ``WeightGrad`` (see ``StoredWeightModule._grad_target``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return sink.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        return (grad.at_rest() if isinstance(grad, WeightGrad) else grad), None


def _bridge(weight: nn.Parameter, shape: tuple[int, ...], layout: Any) -> torch.Tensor:
    """The gradient bridge of ``weight``: built while ``weight`` requires grad (for a
    moment, if it does not now), so that it serves whenever the weight trains."""
    sink = WeightGradInFlight.zeros(shape, layout, weight.dtype, weight.device)
    with requiring_grad(weight):
        return _GradBridge.apply(weight, sink)


RECIPE_METADATA = "amp8_recipe"
"""The key of a layer's recipe in its checkpoint metadata (``state_dict()._metadata``)."""


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


def _state_dict_form(
    module: StoredWeightsModule, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """``state_dict`` post-hook: the plain form (each stored weight's real values in the
    dtype it reports, none of amp8's buffers) or, under ``compact_state_dict`` or where
    FSDP2 shards a weight, the compact form (each weight as stored, with its scales and
    amp8's buffers, and the layer's recipe in its checkpoint metadata). See
    ``amp8.nn.state_dict_form``."""
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
