"""``SingleStoredWeightModule``: the base of amp8's layers with one stored ``weight``.

``Fp8Linear`` and ``LowBitEmbedding`` hold the caller's ``weight`` Parameter with
``w * weight_scale`` in it, the ``weight_scale`` scales, and an ``amp8.tensor.StoredWeight``
handle (``stored_weight``). Backward returns each new FP8 weight gradient, a
``WeightGrad``, to autograd as the gradient of the ``weight`` Parameter itself, or of a
stand-in where the Parameter cannot take it (see ``_grad_target`` and
``amp8.nn.grad_routes``).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.nn.grad_routes import grad_bridge, grad_sink
from amp8.nn.stored_weights import StoredWeightsBase
from amp8.tensor.scaled import ScaledTensor, is_sharded
from amp8.tensor.scaled_weight import ScaledWeight
from amp8.tensor.stored import StoredWeight, stored_weight


class SingleStoredWeightModule(StoredWeightsBase):
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
        self._grad_bridge = None if handle.sharded else grad_bridge(
            self.weight, tuple(self.weight.shape), handle.grad_layout
        )

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

    # -- a weight that torch code replaced -----------------------------------------------
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
