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

import functools
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.quant.checks import check_loaded_scales
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import StoredWeight, requiring_grad, stored_weight
from amp8.tensor.weight_grad import WeightGrad, WeightGradInFlight


class StoredWeightsModule(nn.Module):
    """Base of the modules whose weights amp8 stores scaled (one ``StoredWeight`` per
    weight Parameter, ``stored_weights()``): keeps amp8's dtypes through ``.to()``,
    copies and checkpoints, and re-encodes a weight saved at another storage on load.

    Each weight Parameter ``name`` has a ``{name}_scale`` buffer (saved in
    ``state_dict``): float32, ``name.data == w * scale`` (a scalar for FP16 storage; for
    FP8 storage the weight's scales at the recipe's granularity).
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_record_recipe)

    def stored_weights(self) -> tuple[StoredWeight, ...]:
        """The handles of this module's stored weights."""
        raise NotImplementedError

    def _add_stored_weight(
        self, name: str, weight: nn.Parameter, recipe: Recipe, storage: Precision, *, fixed_storage: bool = False,
    ) -> StoredWeight:
        """Take over ``weight`` as Parameter ``name`` and store its values at ``storage``
        (see ``StoredWeight`` for ``fixed_storage``), with its ``{name}_scale`` buffer."""
        self.register_buffer(f"{name}_scale", torch.ones((), device=weight.device))
        real_weight = weight.detach().float()
        setattr(self, name, weight)
        handle = StoredWeight(self, recipe, storage, fixed_storage=fixed_storage, name=name)
        handle.write(real_weight)
        return handle

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for handle in self.stored_weights():  # copied handles hold no layer, copied Parameters no mark
            handle.bind(self)
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

    def _convert_loaded_weight(
        self, handle: StoredWeight, state_dict: dict[str, Any], prefix: str, block_size: int
    ) -> None:
        """Re-encode ``handle``'s weight saved at another storage (another opt level,
        another recipe's scales, or the plain module amp8 replaced) into this one's, in
        ``state_dict``, with a warning. ``block_size``: that of the saved scales."""
        weight_key, scale_key = prefix + handle.name, prefix + handle.scale_name
        param, stored_scale = handle.param, getattr(self, handle.scale_name)
        saved, saved_scale = state_dict.get(weight_key), state_dict.get(scale_key)
        if saved_scale is not None:
            check_loaded_scales(scale_key, saved_scale)
        if saved is None or (
            saved.dtype == param.dtype and saved_scale is not None
            and saved_scale.shape == stored_scale.shape and saved_scale.dtype == stored_scale.dtype
        ):
            return
        if saved_scale is None:
            saved_scale = torch.ones((), device=saved.device)
        real = ScaledTensor(saved, saved_scale.to(saved.device), block_size).dequantize()
        state_dict[weight_key], state_dict[scale_key] = handle.encode(real.to(param.device))
        warnings.warn(
            f"amp8: converted {weight_key} from {saved.dtype} to {handle.dtype} storage "
            f"(scales of shape {tuple(saved_scale.shape)}, blocks of {block_size}, to "
            f"{tuple(state_dict[scale_key].shape)})",
            stacklevel=3,
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (see
        ``_convert_loaded_weight``; ``args[0]`` is the layer's checkpoint metadata, which
        names the recipe its scales were made with)."""
        saved = saved_recipe(args[0] if args else None)
        for handle in self.stored_weights():
            block_size = handle.recipe.block_size if saved is None else saved["block_size"]
            self._convert_loaded_weight(handle, state_dict, prefix, block_size)
        self.drop_weight_cache()
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._after_move()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "StoredWeightsModule":
        """``.to()``, ``.cuda()``, ``.half()`` and friends: move amp8's tensors to the new
        device, keeping their dtypes (a float32 scale of 2**17 would be inf in FP16)."""
        self.drop_weight_cache()
        kept = {name: (buffer, buffer.dtype) for name, buffer in self._buffers.items() if buffer is not None}
        weights = [(handle, handle.param.dtype, handle.param.data) for handle in self.stored_weights()]
        super()._apply(fn, recurse)
        for name, (original, dtype) in kept.items():
            buffer = self._buffers[name]
            if buffer is not None and buffer.dtype != dtype:
                self._buffers[name] = original.to(buffer.device)
        for handle, dtype, stored in weights:
            param = handle.param
            if param.dtype != dtype and handle.storage is not Precision.AS_IS:
                param.data = stored.to(param.device)
        self._after_apply()
        self._after_move()
        return self

    def _after_apply(self) -> None:
        """What ``_apply`` does last, before ``_after_move``."""


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
        old = self.weight
        self.weight = nn.Parameter(old.detach().narrow(dim, start, length).clone(), requires_grad=old.requires_grad)
        if self.weight_storage is not Precision.AS_IS:
            self.stored_weight.mark(self.weight)
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

    def _check_weight_is_amp8s(self) -> None:
        """Refuse a weight Parameter amp8 did not place: a ``fully_shard`` (or other
        wrapper) applied after ``amp8.initialize`` would reduce a gradient it cannot read."""
        handle = self.stored_weight
        if handle.sharded or handle.storage is Precision.AS_IS or stored_weight(self.weight) is handle:
            return
        raise RuntimeError(
            f"the weight of an amp8 {type(self).__name__} was replaced after amp8.initialize "
            "(by fully_shard, a stock tensor-parallel style, or by assigning a new Parameter); for "
            "tensor parallelism use amp8.distributed.Fp8ColwiseParallel and Fp8RowwiseParallel, "
            "for FSDP2 use opt_level='O3' "
            "in a process group, where amp8 applies fully_shard itself, or "
            "DistributedDataParallel at O1/O2, wrapped after amp8.initialize and registered with "
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


def _record_recipe(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
    """``state_dict`` post-hook: the layer's recipe goes into its checkpoint metadata."""
    local_metadata[RECIPE_METADATA] = recipe_record(module.stored_weights()[0].recipe)
