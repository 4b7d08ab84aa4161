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
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.utils.hooks import RemovableHandle

from amp8.config.formats import E4M3
from amp8.config.levels import Precision
from amp8.config.recipe import Recipe, Scaling
from amp8.quant import scaling
from amp8.quant.codec import Layout, Tiling
from amp8.tensor.scaled import ScaledTensor, is_sharded, local_tensor
from amp8.tensor.scaled_weight import ScaledWeight, chained_nbytes, drop_chain
from amp8.tensor.weight_grad import GradLayout, GradSlot, WeightGrad
from amp8.tensor.weight_grad_ops import PLAIN_GRAD_FIX

STORAGE_DTYPES = {Precision.FP16: torch.float16, Precision.FP8: E4M3}
# Headroom of one binade above an FP16 tensor's amax, so growth between rescales fits.
FP16_MARGIN = 1
_ATTRIBUTE = "_amp8_stored_weight"
PLAIN_LOAD_MARK = "_amp8_plain_loaded"
"""Set in a layer's ``__dict__`` when it loads a stored weight from a plain state dict
(real values, none of amp8's layer state); ``amp8.optim.layer_state`` reads and clears it."""


def check_storage(storage: Precision) -> None:
    """Raise ``ValueError`` unless ``storage`` is a weight storage amp8 has (FP16 or FP8
    with a scale, or ``AS_IS``: the Parameter's own dtype, no scale)."""
    if storage not in STORAGE_DTYPES and storage is not Precision.AS_IS:
        allowed = [p.value for p in (*STORAGE_DTYPES, Precision.AS_IS)]
        raise ValueError(f"weight_storage={storage!r} is not valid; use one of {allowed}")


FP16_LAYOUT = Layout(torch.float16, Tiling.TENSOR, margin=FP16_MARGIN, power_of_2=True, stream=0)
"""How the FP16 weights of O1/O2 and O3's FP16 master weights are stored: one power-of-two
scale with a binade of headroom, rounded stochastically in an optimizer's update (noise
field 0 of its words)."""


def encode_fp16(value: torch.Tensor, words: torch.Tensor | None = None,
                previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(FP16 data, scale)`` for float ``value`` at ``FP16_LAYOUT``, rounded
    stochastically under ``words`` (``amp8.quant.noise.update_words``) where given."""
    data, scale = FP16_LAYOUT.encode(value, words=words, previous=previous)
    assert scale is not None
    return data, scale


def stored_weight(param: torch.Tensor) -> "StoredWeight | None":
    """The handle of an FP8 layer's weight Parameter, or None for any other tensor."""
    return getattr(param, _ATTRIBUTE, None)


@contextlib.contextmanager
def requiring_grad(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """``param`` with ``requires_grad`` on inside the block and as it was after it.

    torch refuses a grad hook on a frozen tensor and records no graph through one; what is
    built for a frozen weight this way stays, and serves if the weight is unfrozen later.
    """
    frozen = not param.requires_grad
    try:
        with torch.enable_grad():
            yield param.requires_grad_(True)
    finally:
        if frozen:
            param.requires_grad_(False)


class StoredWeight:
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

    grad_slot: GradSlot | None = None
    """Where the layer's backward writes the weight's FP8 gradient: views of the gradient
    buffer of the optimizer step that reads it (``amp8.tensor.weight_grad.GradSlot``), or
    None (memory of its own)."""

    def __init__(
        self, module: nn.Module, recipe: Recipe, storage: Precision, *, fixed_storage: bool = False,
        name: str = "weight",
    ) -> None:
        check_storage(storage)
        self.name, self.scale_name = name, f"{name}_scale"
        # Weak: the Parameter refers to this handle, and the layer's gradient bridge (a
        # tensor whose autograd node holds the Parameter, see ``amp8.nn.stored_module``)
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
        if self._hooked is not param or again:
            with requiring_grad(param):
                param.register_post_accumulate_grad_hook(functools.partial(_grad_accumulated, weakref.ref(self)))
            self._hooked = param

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

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype the scales are stored in: the recipe's ``stored_scale_dtype`` for FP8
        storage (E8M0 under MXFP8), else float32."""
        return self.recipe.stored_scale_dtype if self.storage is Precision.FP8 else torch.float32

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight is stored in (float16, float8_e4m3fn, or the Parameter's
        own dtype for ``AS_IS``)."""
        return self.param.dtype if self.storage is Precision.AS_IS else STORAGE_DTYPES[self.storage]

    @property
    def block_size(self) -> int:
        """Elements per block edge of the weight's scales (0 unless the recipe is "block")."""
        return self.recipe.scale_block_size

    def tile(self, contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile of the weight's FP8 scales for a GEMM contracting its dim
        ``contract_dim`` (1: the forward GEMM, 0: the input-gradient GEMM); each expert's
        own tiles for a stack of experts' matrices."""
        shape = tuple(self.param.shape)
        return scaling.matrix_tile(self.recipe.tile(shape[-2:], contract_dim, weight=True), shape)

    def state_tile(self) -> tuple[int, int] | None:
        """The tile of the scales of Adam's FP8 first moment of this weight: the tiles of
        the weight's FP8 scales, or one per row for a weight of fixed storage and for a
        stack of experts' matrices that takes one scale per expert."""
        shape = tuple(self.param.shape)
        tile = self.tile()
        if self.sharded:  # the optimizer keeps a sharded weight's state as flat chunks, in blocks
            return None
        if self.fixed_storage or (len(shape) > 2 and tile == shape[-2:]):
            return (1, shape[-1])
        return tile

    def state_scale_dtype(self) -> torch.dtype:
        """The dtype of those first-moment scales: the recipe's ``stored_scale_dtype`` at
        the weight's tiles (E8M0 under MXFP8), float32 per row for fixed storage."""
        return torch.float32 if self.fixed_storage else self.recipe.stored_scale_dtype

    def stored(self) -> ScaledTensor:
        """The stored data (this rank's rows of a sharded weight) with its scales."""
        data = self.data
        if not torch.compiler.is_compiling():
            drop_chain(data)
        data = data.detach()
        return ScaledTensor(data, self._scale_of_rows(self.scale, data), self.block_size)

    def local_rows(self) -> tuple[int, int]:
        """``[start, end)`` of the rows (dim 0) this rank stores: FSDP2 gives each rank
        ``ceil(rows / ranks)`` rows in rank order; all of them where not sharded."""
        param = self.param
        rows = local_tensor(param).shape[0]
        if not is_sharded(param):
            return 0, rows
        start = min(param.device_mesh.get_local_rank() * -(-param.shape[0] // param.device_mesh.size()), param.shape[0])
        return start, start + rows

    def _scale_of_rows(self, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The scales of ``rows`` (this rank's rows of the weight) among the whole
        weight's ``scale``: those of its experts, for a stack with scales per expert
        sharded over ranks; else ``scale`` itself."""
        if scale.dim() == 0 or not is_sharded(self.param):
            return scale
        start, end = self.local_rows()
        return scale[start:end]

    def amax_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The amaxes this rank's ``rows`` of a sharded weight add to the whole weight's
        (taken as the max over ranks): one for a weight with one scale; for a stack of
        experts with one scale per expert, one per expert of the whole stack, zero for
        the experts other ranks hold."""
        if self.storage is not Precision.FP8 or len(self.param.shape) < 3 or self.tile() is None:
            return rows.abs().amax() if rows.numel() else rows.new_zeros(())
        whole = rows.new_zeros((self.param.shape[0], 1, 1))
        start, end = self.local_rows()
        if end > start:
            whole[start:end] = scaling.tile_amax(rows, self.tile())
        return whole

    def read(self) -> torch.Tensor:
        """The weight's real values in float32 (this rank's rows of a sharded weight,
        outside forward and backward)."""
        return self.stored().dequantize()

    @property
    def layout(self) -> Layout:
        """How the stored data encode the weight (``amp8.quant.codec``): FP16 with one
        power-of-two scale, or FP8 at the recipe's scale tiles; float32 as is for
        ``AS_IS`` storage."""
        if self.storage is Precision.FP16:
            return FP16_LAYOUT
        if self.storage is not Precision.FP8:
            return Layout()
        recipe = self.recipe
        return Layout.for_tile(self.dtype, self.tile(), tuple(self.param.shape), margin=recipe.margin,
                               power_of_2=recipe.power_of_2_scales, scale_dtype=self.scale_dtype)

    def encode(
        self,
        value: torch.Tensor,
        words: torch.Tensor | None = None,
        amax_value: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale)`` that store float ``value`` in this weight's storage
        (``layout``), with float32 scales.

        FP16 storage rounds stochastically under ``words`` (an optimizer update's
        ``amp8.quant.noise.update_words``) where given. ``scale`` replaces the scales
        from the value's amaxes (an optimizer's scale from a bound); ``amax_value``
        replaces those amaxes (to encode one rank's rows of a sharded weight with the
        scales of the whole, ``amax_of_rows`` taken over all ranks); the scales returned
        are the whole weight's.
        """
        if self.storage is Precision.AS_IS:
            return value.to(self.param.dtype), torch.ones((), device=value.device)
        layout = self.layout
        if amax_value is not None:
            previous = self.scale if self.scale.shape == amax_value.shape else None
            scale = layout.scales(amax_value, previous)
        if scale is None and not is_sharded(self.param):
            data, stored = layout.encode(value, words=words, previous=self.scale)
            assert stored is not None
            return data, stored.float()
        if scale is None:
            amaxes = layout.amaxes(value)
            scale = layout.scales(amaxes, self.scale if self.scale.shape == amaxes.shape else None)
        full_scale = scaling.expand_scale(self._scale_of_rows(scale, value), tuple(value.shape), self.block_size)
        return layout.encode(value, full_scale, words)[0], scale

    def write(self, value: torch.Tensor, words: torch.Tensor | None = None) -> None:
        """Store float ``value`` as the weight's new real values, in place (stochastically
        rounded under ``words``): the path of every write from outside the optimizer.
        At O3 the optimizer's master weight takes ``value`` first (``attach_master``), and
        the FP8 weight is encoded from it, so the next step starts from what was written."""
        if self._master is not None:
            self._master(value)
        self.store_from_master(*self.encode(value, words))

    def attach_master(self, master_writer: Callable[[torch.Tensor], None] | None) -> None:
        """Make ``master_writer(value)`` (which stores float32 ``value``, this rank's rows,
        as the master weight) part of this weight: every ``write`` goes there too. The
        optimizer that keeps O3's master weight attaches it; None detaches it."""
        self._master = master_writer

    def attach_load_log(self, log: list[str] | None) -> None:
        """Have ``note_plain_load`` append this weight's name to ``log`` (an optimizer's:
        one list for all its weights, so its step asks one ``if`` whether any layer was
        loaded from a plain state dict since); None detaches it."""
        self._load_log = log

    def note_plain_load(self) -> None:
        """Say that the weight was loaded from a plain state dict (real values, none of
        amp8's layer state): its name goes to the attached load log."""
        if self._load_log is not None:
            self._load_log.append(self.name)

    def store(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Store already encoded ``data`` (this rank's rows of a sharded weight) and its
        ``scale``, in place (a checkpoint's stored form). At O3 the master weight takes
        their real values (see ``attach_master``)."""
        if self._master is not None:
            self._master(ScaledTensor(data, scale.float(), self.block_size).dequantize())
        self.store_from_master(data, scale)

    def store_from_master(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Store ``data`` and ``scale``, encoded by the optimizer from the master weight it
        has just written (or where there is none), in place; the master is left as it is."""
        param, module = self.param, self._module
        module.drop_weight_cache()
        with torch.no_grad():
            stored_scale = self.stored_scale
            if stored_scale.shape == scale.shape and stored_scale.dtype == self.scale_dtype:
                stored_scale.copy_(scale)  # to E8M0 exactly: its scales are powers of two
            else:  # FP16 and FP8 storage of fine-grained recipes keep different scale shapes
                self._scale_memory = scale.to(self.scale_dtype, copy=True)
            current = self.data
            if current.dtype == data.dtype:
                current.copy_(data)
            elif isinstance(param, ScaledWeight):  # another storage (O3's FP8 beside FP16 masters)
                param._data = data.detach().clone()
            else:
                param.data = data
            # A write from a tensor subclass's dispatch runs below autograd, where torch does
            # not count it: count it, so whatever keys on the version sees it.
            increment_version([self.data, self.stored_scale])
            self.refresh()

    def place(self, memory: torch.Tensor) -> None:
        """Keep the stored tensor in ``memory`` (a tensor of its dtype and shape, such as
        a view into an optimizer's flat buffer): the values are copied there and the
        Parameter holds ``memory`` from now on."""
        param = self.param
        if not isinstance(param, ScaledWeight):
            raise ValueError(f"the weight {self.name!r} is kept as it is, not stored: nothing to place")
        if _copied_into(memory, self.data, "a stored weight"):
            param._data = memory

    def place_scale(self, memory: torch.Tensor) -> None:
        """Keep the scales in ``memory`` (a tensor of their dtype and shape, such as a
        view into an optimizer's vector of scales): the scales are copied there, and the
        handle and the Parameter hold ``memory`` from now on."""
        if _copied_into(memory, self.stored_scale, "scales"):
            self.set_stored_scale(memory)

    def changed(self) -> None:
        """Say that the stored tensor or its scales were written in place (by an
        optimizer step over its memory): the layer drops its cached casts."""
        self._module.drop_weight_cache()

    def cache_dropper(self) -> Callable[[], None]:
        """What ``changed`` calls, bound to the layer: for a caller that says so of
        thousands of weights each step (it holds the layer while it keeps this)."""
        return self._module.drop_weight_cache

    def scale_slot(self) -> tuple[dict[str, Any], str]:
        """A registry and a name in it such that ``stored_scale`` is ``registry.get(name)``,
        read with no property call (a caller that reads thousands of them each step keeps
        the registry)."""
        return self.__dict__, "_scale_memory"

    def restore(self, storage: Precision) -> None:
        """Re-store the weight as FP16 or FP8 (O3 keeps FP8 weights beside FP16 masters)."""
        check_storage(storage)
        real = self.read()
        self.storage = storage
        self.write(real)

    def delayed_scaling_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's ``(amax_history, scale)`` buffers under delayed scaling (which ranks
        must agree on), else None."""
        if self.recipe.scaling is not Scaling.DELAYED:
            return None
        return self._module.amax_history, self._module.scale

    # -- gradient --------------------------------------------------------------------
    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 dtype of the weight gradient (``Recipe.weight_grad_format``)."""
        return self.recipe.weight_grad_dtype

    @property
    def grad_layout(self) -> GradLayout:
        """How the weight gradient is stored (``GradLayout.for_weight`` of the recipe)."""
        return GradLayout.for_weight(self.recipe, tuple(self.param.shape))

    def grad_tile(self) -> tuple[int, int] | None:
        """The tile of the weight gradient's scales (``Recipe.weight_grad_scaling``)."""
        return self.grad_layout.tile

    @property
    def grad_block_size(self) -> int:
        """Elements per block edge of the gradient's scales (0 unless they are blocks)."""
        return self.grad_layout.block_size

    def grad(self) -> ScaledTensor | None:
        """The weight gradient as FP8 + scales, or None. Like ``param.grad`` it is live:
        a later backward or clip changes it in place."""
        if self.sharded:
            return None if self._held_grad is None else self._held_grad.fp8
        param = self.param
        grad = param.grad
        if grad is None:
            return None
        if not isinstance(grad, WeightGrad):
            if not (type(grad) is torch.Tensor and grad.is_floating_point() and grad.shape == param.shape):
                raise TypeError(
                    f"the weight gradient of an FP8 layer must be an amp8 WeightGrad (FP8 + "
                    f"scale), found a {type(grad).__name__} of {grad.dtype}; {PLAIN_GRAD_FIX}"
                )
            # Model code that reads the weight itself (a product with ``layer.weight``)
            # gets its real gradient from autograd: stored in FP8 like the layer's own.
            self.set_grad_from_float(grad.float())
            grad = param.grad
        return grad.fp8

    def set_grad(self, value: ScaledTensor | None) -> None:
        """Replace the gradient (None clears it): ``value`` must have the gradient's FP8
        dtype, the weight's shape and the weight's scale layout."""
        if value is not None:
            self._check_grad(value)
        grad = None if value is None else WeightGrad(value, self.param.dtype, self.grad_layout)
        if self.sharded:
            self._held_grad = grad
        else:
            self.param.grad = grad

    def clear_grad(self) -> None:
        """Drop the gradient."""
        self.set_grad(None)

    def quantize_grad(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(FP8 data, scales)`` of a float weight gradient at ``grad_layout``: fresh
        scales per tile (what backward and accumulation use)."""
        fp8 = self.grad_layout.quantize(value)
        return fp8.data, fp8.scale

    def set_grad_from_float(self, value: torch.Tensor) -> None:
        """Store float ``value`` as the gradient, in FP8 with fresh scales."""
        self.set_grad(self.grad_layout.quantize(value))

    def add_grad(self, grad: WeightGrad) -> None:
        """A sharded weight's new gradient from backward (see ``shard``): it becomes the
        gradient the handle holds, or is added to it (gradient accumulation) and stored
        again with fresh scales. Then the grad-ready hooks run."""
        if self._held_grad is None:
            self._held_grad = grad.at_rest()
        else:
            self._held_grad.add_(grad)
        self.run_grad_ready_hooks()

    def register_grad_ready_hook(self, hook: Callable[[nn.Parameter], None]) -> RemovableHandle:
        """Call ``hook(param)`` after each backward has added to the gradient (the
        Parameter's post-accumulate-grad hook, or ``add_grad`` for a sharded weight)."""
        handle = RemovableHandle(self._grad_ready_hooks)
        self._grad_ready_hooks[handle.id] = hook
        return handle

    def run_grad_ready_hooks(self) -> None:
        """Run the hooks of ``register_grad_ready_hook``."""
        for hook in list(self._grad_ready_hooks.values()):
            hook(self.param)

    @property
    def grad_scale_shape(self) -> torch.Size:
        """The shape of the gradient's scales (one per ``grad_tile``)."""
        return self.grad_layout.scale_shape(tuple(self.param.shape))

    def _check_grad(self, value: ScaledTensor) -> None:
        expected_scale = self.grad_scale_shape
        if value.dtype != self.grad_dtype or value.shape != self.param.shape or (
            value.scale.shape != expected_scale
        ):
            raise ValueError(
                f"a weight gradient of {value.dtype}, shape {tuple(value.shape)}, scales of shape "
                f"{tuple(value.scale.shape)} does not fit this weight: {self.grad_dtype}, shape "
                f"{tuple(self.param.shape)}, scales {tuple(expected_scale)}"
            )


def _grad_accumulated(handle: "weakref.ref[StoredWeight]", param: nn.Parameter) -> None:
    """The Parameter's post-accumulate-grad hook: its handle's grad-ready hooks run."""
    stored = handle()
    if stored is not None:
        stored.run_grad_ready_hooks()


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


__all__ = [
    "PLAIN_LOAD_MARK", "StoredWeight", "WeightGrad", "encode_fp16", "float_grad", "is_fp8_weight", "is_sharded",
    "stored_weight",
]


def _copied_into(memory: torch.Tensor, current: torch.Tensor, what: str) -> bool:
    """Copy ``current`` into ``memory`` (same dtype and shape, else a ValueError naming
    ``what``); False where ``memory`` is ``current`` already."""
    if memory.dtype != current.dtype or memory.shape != current.shape:
        raise ValueError(
            f"cannot keep {what} of {current.dtype} {tuple(current.shape)} in a tensor of "
            f"{memory.dtype} {tuple(memory.shape)}"
        )
    if memory is current:
        return False
    with torch.no_grad():
        memory.copy_(current)
    return True
