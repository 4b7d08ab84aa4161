"""``WritePath``: the part of ``amp8.tensor.stored.StoredWeight`` that every write of the
weight goes through (``encode``, ``write``, ``store``), keeping its data, scales and, at
O3, the optimizer's master weight one unit; and where an optimizer keeps the stored data
and scales (``place``, ``place_scale``) and drops the casts it made stale (``cache_dropper``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version

from amp8.config.levels import Precision
from amp8.quant import scaling
from amp8.quant.codec import Layout
from amp8.tensor.scaled import ScaledTensor, is_sharded
from amp8.tensor.scaled_weight import ScaledWeight
from amp8.tensor.stored_layout import check_storage


class WritePath:
    """The writes of ``StoredWeight`` (see its class docstring)."""

    name: str
    storage: Precision
    _master: Callable[[torch.Tensor], None] | None
    _load_log: list[str] | None
    _scale_memory: torch.Tensor

    if TYPE_CHECKING:  # defined by StoredWeight, StorageLayout and LocalRows
        @property
        def _module(self) -> nn.Module: ...

        @property
        def param(self) -> nn.Parameter: ...

        @property
        def data(self) -> torch.Tensor: ...

        @property
        def scale(self) -> torch.Tensor: ...

        @property
        def stored_scale(self) -> torch.Tensor: ...

        @property
        def scale_dtype(self) -> torch.dtype: ...

        @property
        def block_size(self) -> int: ...

        @property
        def layout(self) -> Layout: ...

        def set_stored_scale(self, scale: torch.Tensor) -> None: ...

        def refresh(self) -> None: ...

        def read(self) -> torch.Tensor: ...

        def _scale_of_rows(self, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...

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

    def cache_dropper(self) -> Callable[[], None]:
        """The layer's ``drop_weight_cache``, for a caller that writes the stored tensor or
        its scales in place (an optimizer step over its memory) for thousands of weights
        each step (it holds the layer while it keeps this)."""
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
