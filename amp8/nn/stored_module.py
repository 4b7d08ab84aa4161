"""``StoredWeightModule``: the part of an amp8 layer that stores its weight.

A layer whose weight amp8 stores scaled (``Fp8Linear``, ``LowBitEmbedding``) holds the
caller's ``weight`` Parameter with ``w * weight_scale`` in it, the ``weight_scale``
buffer, and an ``amp8.StoredWeight`` handle that the optimizer, clipping and the
gradient reduction go through. Backward hands each new FP8 weight gradient out through a
grad sink (see ``_make_grad_sink``); it lands in ``weight.grad`` as a ``WeightGrad``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from ..checks import check_loaded_scales
from ..levels import Precision
from ..recipe import Recipe
from ..stored_weight import StoredWeight, stored_weight
from ..tensor import ScaledTensor


class StoredWeightModule(nn.Module):
    """Base of the modules whose weight amp8 stores: builds the storage in
    ``_init_storage`` and keeps amp8's dtypes through ``.to()``, copies and checkpoints.

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
        device = weight.device
        self.register_buffer("weight_scale", torch.ones((), device=device))
        real_weight = weight.detach().float()
        self.weight = weight
        self.stored_weight = StoredWeight(self, recipe, storage, self.drop_weight_cache, fixed_storage=fixed_storage)
        # Backward writes the scales of each new FP8 weight gradient here, in place, and
        # returns its data as the gradient of ``_grad_sink``; see ``_new_weight_grad``.
        self.register_buffer(
            "_grad_scale", torch.ones(self.stored_weight.grad_scale_shape, device=device), persistent=False
        )
        self._make_grad_sink()
        self.stored_weight.write(real_weight)

    def drop_weight_cache(self) -> None:
        """Forget anything derived from the stored weight (nothing here; ``Fp8Linear``
        caches its FP8 casts)."""

    def _after_move(self) -> None:
        """Re-bind what refers to buffers that ``.to()``, a copy or a load replaced."""

    # -- the weight gradient's way out of backward -------------------------------------
    def _make_grad_sink(self) -> None:
        """A leaf that holds no memory (one element, expanded to the weight's shape) and
        requires grad: backward returns each new FP8 weight gradient as its gradient, and
        its hook, which runs eagerly also after a compiled backward, hands it on. The
        gradient cannot be returned for the weight itself: autograd would cast it to the
        weight's dtype."""
        dtype = self.stored_weight.grad_dtype
        sink = torch.zeros((), dtype=dtype, device=self.weight_scale.device).expand(self.weight.shape)
        sink.requires_grad_(True)
        sink.register_post_accumulate_grad_hook(self._new_weight_grad)
        self._grad_sink = sink

    def _new_weight_grad(self, sink: torch.Tensor) -> None:
        data, sink.grad = sink.grad, None
        self.stored_weight.add_grad(data, self._grad_scale.clone())

    def _sink(self) -> torch.Tensor | None:
        """The grad sink where backward should return an FP8 weight gradient, or None
        (the weight needs no gradient, or it is stored as the model keeps it)."""
        fp8_grad = self.weight_storage is not Precision.AS_IS
        return self._grad_sink if self.weight.requires_grad and fp8_grad else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_grad_sink", None)  # a leaf with a hook does not pickle; rebuilt below
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._make_grad_sink()
        self._after_move()
        if self.weight_storage is not Precision.AS_IS:  # a copied Parameter loses its mark
            self.stored_weight.mark(self.weight)

    # -- weight storage (see ``amp8.StoredWeight``) ------------------------------------
    @property
    def weight_storage(self) -> Precision:
        """How the weight is stored: ``Precision.FP16``, ``Precision.FP8`` or ``AS_IS``."""
        return self.stored_weight.storage

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
        backward, when FSDP2 shards the weight: see ``amp8.comm.fsdp``)."""
        return self.stored_weight.read()

    def write_weight(self, real_weight: torch.Tensor, noise_key: torch.Tensor | int | None = None) -> None:
        """Store ``real_weight`` (any float dtype) into the weight Parameter, in place,
        rounded stochastically under ``noise_key`` when one is given."""
        self.stored_weight.write(real_weight, noise_key)

    def set_weight_storage(self, weight_storage: Precision) -> None:
        """Re-store the weight as FP16 or FP8 (O3 keeps FP8 weights beside FP16 masters)."""
        self.stored_weight.restore(weight_storage)

    @property
    def weight_grad(self) -> ScaledTensor | None:
        """The weight gradient as FP8 + scales, or None: the FP8 tensors inside
        ``weight.grad`` (see ``amp8.StoredWeight.grad``). Assign None to clear it, or a
        ``ScaledTensor`` of the gradient's dtype, shape and scale layout to replace it."""
        return self.stored_weight.grad()

    @weight_grad.setter
    def weight_grad(self, value: ScaledTensor | None) -> None:
        self.stored_weight.set_grad(value)

    def _convert_loaded_weight(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Re-encode a weight saved at another storage (another opt level, or the plain
        module amp8 replaced) into this one's, in ``state_dict``, with a warning."""
        weight_key, scale_key = prefix + "weight", prefix + "weight_scale"
        saved, saved_scale = state_dict.get(weight_key), state_dict.get(scale_key)
        if saved_scale is not None:
            check_loaded_scales(scale_key, saved_scale)
        if saved is None or (
            saved.dtype == self.weight.dtype and saved_scale is not None and saved_scale.shape == self.weight_scale.shape
        ):
            return
        if saved_scale is None:
            saved_scale = torch.ones((), device=saved.device)
        real = ScaledTensor(saved, saved_scale.to(saved.device), self.stored_weight.recipe.block_size).dequantize()
        state_dict[weight_key], state_dict[scale_key] = self.stored_weight.encode(real.to(self.weight.device))
        warnings.warn(
            f"amp8: converted {weight_key} from {saved.dtype} to {self.weight_dtype} storage "
            f"(scales of shape {tuple(saved_scale.shape)} to {tuple(state_dict[scale_key].shape)})",
            stacklevel=3,
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (see
        ``_convert_loaded_weight``)."""
        self._convert_loaded_weight(state_dict, prefix)
        self.drop_weight_cache()
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._after_move()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "StoredWeightModule":
        """``.to()``, ``.cuda()``, ``.half()`` and friends: move amp8's tensors to the new
        device, keeping their dtypes (a float32 scale of 2**17 would be inf in FP16)."""
        self.drop_weight_cache()
        kept = {name: (buffer, buffer.dtype) for name, buffer in self._buffers.items() if buffer is not None}
        weight_dtype, stored = self.weight.dtype, self.weight.data
        super()._apply(fn, recurse)
        device = self.weight.device
        for name, (original, dtype) in kept.items():
            buffer = self._buffers[name]
            if buffer is not None and buffer.dtype != dtype:
                self._buffers[name] = original.to(device)
        if self.weight.dtype != weight_dtype and self.weight_storage is not Precision.AS_IS:
            self.weight.data = stored.to(device)
        if self._grad_sink.device != device:
            self._make_grad_sink()
        self._after_move()
        return self

    def _check_weight_is_amp8s(self) -> None:
        """Refuse a weight Parameter amp8 did not place: a ``fully_shard`` (or other
        wrapper) applied after ``amp8.initialize`` would reduce a gradient it cannot read."""
        handle = self.stored_weight
        if handle.sharded or handle.storage is Precision.AS_IS or stored_weight(self.weight) is handle:
            return
        raise RuntimeError(
            f"the weight of an amp8 {type(self).__name__} was replaced after amp8.initialize "
            "(by fully_shard, or by assigning a new Parameter); for FSDP2 use opt_level='O3' "
            "in a process group, where amp8 applies fully_shard itself, or "
            "DistributedDataParallel at O1/O2, wrapped after amp8.initialize"
        )
