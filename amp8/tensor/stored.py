"""``StoredWeight``: how one FP8 layer stores its weight, and where the weight's gradient
lives. The layer, the optimizer, gradient clipping and the gradient reduction all go
through this one handle (``amp8.tensor.stored_weight(param)`` finds it from the Parameter).

Storage: the weight Parameter holds ``w * scale`` in FP16 (one power-of-two scale with a
binade of headroom) or in FP8 (the recipe's scales at its granularity, which feed the
GEMMs directly). The handle owns the scales (``stored_scale``; the layer's
``weight_scale`` reads them): they are no module buffer, so no tool that copies buffers
(``AveragedModel``, DDP's buffer broadcast) can pair one weight's data with another's
scales. Every write of the weight goes through ``store``, which keeps data, scales and,
at O3, the optimizer's master weight (``attach_master``) as one unit.

Gradient: backward returns each new FP8 weight gradient to autograd as the Parameter's
own gradient, a ``WeightGrad`` (one byte per element at ``grad_layout``), so it lands in
``param.grad``, where hooks, ``model.zero_grad()``, ``optimizer.zero_grad()`` and
``torch.nn.utils.clip_grad_norm_`` find it; the handle reads it there. A weight that
FSDP2 shards keeps its gradient on the handle instead (FSDP2 would reduce a ``.grad`` it
finds with its own collectives): backward returns it to a sink, which hands it to
``add_grad``, and amp8's gradient reduction reads it there.

``StoredWeight`` is built from one part per job, each in a module of its own: the storage
format (``amp8.tensor.stored_layout``), the rows a rank stores of a sharded weight
(``amp8.tensor.stored_rows``), the write path (``amp8.tensor.stored_writes``) and the
gradient home (``amp8.tensor.stored_grad``). This module holds the handle itself: how it
binds to its layer and Parameter, what it stores, and how a Parameter finds it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe, Scaling
from amp8.tensor.scaled import ScaledTensor, local_tensor
from amp8.tensor.scaled_weight import ScaledWeight, chained_nbytes, drop_chain
from amp8.tensor.stored_grad import GradHome
from amp8.tensor.stored_layout import StorageLayout, check_storage
from amp8.tensor.stored_rows import LocalRows
from amp8.tensor.stored_writes import WritePath
from amp8.tensor.weight_grad import WeightGrad

_ATTRIBUTE = "_amp8_stored_weight"
PLAIN_LOAD_MARK = "_amp8_plain_loaded"
"""Set in a layer's ``__dict__`` when it loads a stored weight from a plain state dict
(real values, none of amp8's layer state); ``amp8.optim.layer_state`` reads and clears it."""


def stored_weight(param: torch.Tensor) -> "StoredWeight | None":
    """The handle of an FP8 layer's weight Parameter, or None for any other tensor."""
    return getattr(param, _ATTRIBUTE, None)


class StoredWeight(StorageLayout, LocalRows, WritePath, GradHome):
    """The stored weight of one FP8 layer (``module.weight`` and ``module.weight_scale``,
    or another Parameter ``name`` and its ``{name}_scale`` buffer).

    Args:
        module: the layer that owns the Parameter and the scale buffer; its
            ``drop_weight_cache()`` is called whenever the stored weight changes (the
            layer drops its cached FP8 casts).
        recipe: the layer's FP8 recipe (granularity, margin, power-of-two scales, formats).
        storage: ``Precision.FP16`` or ``Precision.FP8``.
        fixed_storage: the weight keeps ``storage`` at every opt level: no FP8 copy, no
            master weight, never sharded (an embedding's FP16 table, which forward reads
            row by row). Its Adam first moment takes one scale per row.
        name: the Parameter's name in ``module``; a stack of experts' (E, N, K) weights
            (``amp8.nn.Fp8Experts``) takes its scales per expert matrix
            (``scaling.matrix_tile``).
    """

    def __init__(
        self, module: nn.Module, recipe: Recipe, storage: Precision, *, fixed_storage: bool = False,
        name: str = "weight",
    ) -> None:
        check_storage(storage)
        self.name, self.scale_name = name, f"{name}_scale"
        # Weak: the Parameter refers to this handle, and the layer's gradient bridge (a
        # tensor whose autograd node holds the Parameter, see ``amp8.nn.grad_routes.grad_bridge``)
        # to the Parameter; a strong way back to the layer would be a cycle through C++
        # that the garbage collector cannot see.
        self._module_ref: weakref.ref[nn.Module] | None = weakref.ref(module)
        self.recipe = recipe
        self.storage = storage
        self.fixed_storage = fixed_storage
        self.sharded = False  # set by ``shard`` (see amp8.distributed.fsdp)
        self._held_grad: WeightGrad | None = None
        self._grad_ready_hooks: OrderedDict[int, Callable[[nn.Parameter], None]] = OrderedDict()
        # The Parameter that runs them. Strong, not weak: torch refuses to swap a tensor a
        # weak reference points at (``swap_tensors``, which parametrizations use).
        self._hooked: nn.Parameter | None = None
        self._scale_memory: torch.Tensor = torch.ones(())
        self._master: Callable[[torch.Tensor], None] | None = None
        self._load_log: list[str] | None = None  # see ``attach_load_log``
        if storage is not Precision.AS_IS:  # an AS_IS weight is a plain Parameter to everyone
            self._take_over(self.param)
            self.mark(self.param)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the model) starts with no gradient, no gradient
        slot and no hooks: those belong to the original's optimizer and run. It holds no layer either: the
        copied layer binds it (``bind``), so a copy rebuilds alike whichever of the two
        it reaches first."""
        state = self.__dict__.copy()
        state.update(
            _held_grad=None, _grad_ready_hooks=OrderedDict(), _hooked=None, _module_ref=None, _master=None, grad_slot=None,
            _load_log=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from ``__getstate__``; the layer binds the handle when it is rebuilt."""
        self.__dict__.update(state)
        module = state.get("_module_ref")
        if isinstance(module, nn.Module):  # saved by an amp8 that kept the layer in the state
            self._module_ref = weakref.ref(module)

    def bind(self, module: nn.Module) -> None:
        """Make ``module`` the layer that owns this weight (a copied layer takes its copied
        handle so) and attach the handle to its Parameter (see ``mark``)."""
        self._module_ref = weakref.ref(module)
        if self.storage is not Precision.AS_IS:
            self.mark(self.param)

    @property
    def _module(self) -> nn.Module:
        module = None if self._module_ref is None else self._module_ref()
        if module is None:
            raise RuntimeError(
                "the layer that stored this weight was deleted, or the weight was copied without "
                "its layer; keep the model alive while training it, and copy the model, not the weight"
            )
        return module

    def mark(self, param: nn.Parameter, again: bool = False) -> None:
        """Attach this handle to ``param``, so ``stored_weight(param)`` finds it, and run
        the grad-ready hooks after each backward has accumulated into ``param.grad``
        (registered ``again`` where the tensor was swapped whole)."""
        setattr(param, _ATTRIBUTE, self)
        self._hook_grad_ready(param, again)

    def _take_over(self, param: nn.Parameter) -> None:
        """Store ``param``'s values and make ``param`` itself (the same object: optimizers
        and tied modules hold it) a ``ScaledWeight`` around the storage, reporting the
        dtype it had."""
        data, scale = self.encode(param.detach().float())
        module = self._module
        self._scale_memory = scale.to(self.scale_dtype, copy=True)
        weight = nn.Parameter(
            ScaledWeight(data, self.stored_scale, self.block_size, param.dtype, self.write),
            requires_grad=param.requires_grad,
        )
        # The user's own attributes on the Parameter stay (hooks stay with the old tensor).
        weight.__dict__.update({
            key: value for key, value in param.__dict__.items()
            if key not in weight.__dict__ and not key.endswith("_hooks") and key != _ATTRIBUTE
        })
        try:
            torch.utils.swap_tensors(param, weight)
        except RuntimeError as error:
            raise RuntimeError(
                f"amp8 cannot take over the weight Parameter {self.name!r} of {type(module).__name__} "
                f"({error}); call amp8.initialize on the model as built, before other tools hold its "
                "Parameters (weak references, views or autograd graphs of them)"
            ) from error

    def shard(self, param: nn.Parameter) -> None:
        """Attach this handle to ``param``, the Parameter FSDP2 put in place, which holds
        this rank's rows: from now on the gradient stays on the handle (see ``add_grad``)."""
        setattr(param, _ATTRIBUTE, self)
        self.sharded = True

    # -- storage ---------------------------------------------------------------------
    @property
    def param(self) -> nn.Parameter:
        """The weight Parameter as the layer holds it now."""
        module = self._module
        # The registry first: ``getattr`` runs nn.Module's fallback lookup, which an
        # optimizer step over thousands of weights would pay for each of them.
        param = module._parameters.get(self.name)
        return param if param is not None else getattr(module, self.name)

    @property
    def scale(self) -> torch.Tensor:
        """The weight's scales in float32 (the layer's ``weight_scale`` buffer, which
        holds them as ``scale_dtype``)."""
        return self.stored_scale.float()

    @property
    def stored_scale(self) -> torch.Tensor:
        """The scales themselves (``scale_dtype``), which this handle owns: what an
        in-place update of the scales writes into."""
        return self._scale_memory

    def set_stored_scale(self, scale: torch.Tensor) -> None:
        """Hold ``scale`` (``scale_dtype``, kept, not copied) as the weight's scales from
        now on (``.to()``, a load)."""
        self._scale_memory = scale
        self.refresh()

    @property
    def data(self) -> torch.Tensor:
        """The stored tensor (this rank's rows of a sharded weight): ``w * scale`` in FP16
        or FP8, which the Parameter (a ``ScaledWeight``) holds; the Parameter itself for
        ``AS_IS`` storage."""
        param = self.param
        return param._data if isinstance(param, ScaledWeight) else local_tensor(param)

    @property
    def version(self) -> tuple[int, int, int, int]:
        """Changes whenever the stored data or scales change, by whichever path: which
        tensors hold them and torch's version counters of both (every in-place write
        counts). Whatever is derived from the stored weight (a layer's FP8 casts) is
        valid while this stays the same."""
        data, scale = self.data, self._scale_memory
        return id(data), data._version, id(scale), scale._version

    @property
    def nbytes(self) -> int:
        """Bytes the stored weight holds on this rank: its data and its scales, as stored,
        plus the float32 values a chain of in-place writes keeps until the weight is next
        read or used (``amp8.tensor.scaled_weight.chained_nbytes``): the report shows them."""
        data = self.data
        return data.nbytes + self.stored_scale.nbytes + chained_nbytes(data)

    def refresh(self) -> None:
        """Point the Parameter at the scales this handle holds now."""
        param = self.param
        if isinstance(param, ScaledWeight):
            param._scale = self.stored_scale

    def stored(self) -> ScaledTensor:
        """The stored data (this rank's rows of a sharded weight) with its scales."""
        data = self.data
        if not torch.compiler.is_compiling():
            drop_chain(data)
        data = data.detach()
        return ScaledTensor(data, self._scale_of_rows(self.scale, data), self.block_size)

    def read(self) -> torch.Tensor:
        """The weight's real values in float32 (this rank's rows of a sharded weight,
        outside forward and backward), decoded by the storage codec (``layout``)."""
        stored = self.stored()
        return self.layout.decode(stored.data, stored.scale)

    def delayed_scaling_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's ``(amax_history, scale)`` buffers under delayed scaling (which ranks
        must agree on), else None."""
        if self.recipe.scaling is not Scaling.DELAYED:
            return None
        return self._module.amax_history, self._module.scale


def float_grad(param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s gradient in float32 as backward left it: the real values of an FP8
    layer's weight gradient (see ``StoredWeight.grad``), else ``param.grad``."""
    handle = stored_weight(param)
    if handle is not None:
        grad = handle.grad()
        return None if grad is None else grad.dequantize()
    return None if param.grad is None else param.grad.float()


def is_fp8_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` is the weight of an FP8 layer (it has a ``StoredWeight``)."""
    return stored_weight(param) is not None


__all__ = ["PLAIN_LOAD_MARK", "StoredWeight", "WeightGrad", "float_grad", "is_fp8_weight", "stored_weight"]
