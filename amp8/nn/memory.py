"""Bytes autograd saves for backward, counted as they are packed.

``count_saved_bytes(model)`` wraps a forward (and its backward) and adds up what autograd
keeps for backward through ``torch.autograd.graph.saved_tensors_hooks``. Each storage is
counted once, at its full size (a saved view keeps its whole storage alive); storages of
the model's parameters and buffers are not counted (they are persistent memory, which
``amp8.report`` counts per parameter), and copies of parameters (autocast's BF16
weights) are counted apart, since they do not grow with the batch. Where amp8 stores saved tensors in FP8
(``Recipe(activations="fp8")``) the FP8 data and its scales are counted, not the tensor
they replace.

Only tensors autograd packs are seen: a ``torch.autograd.Function`` that keeps tensors as
attributes of ``ctx`` (rather than through ``ctx.save_for_backward``) hides them.
``Fp8Linear`` saves its input through ``save_for_backward``; its FP8 weight casts are
the layer's cache and are not counted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
from torch import nn

from amp8.config.formats import short_name
from amp8.tensor.scaled_weight import ScaledWeight

STORAGE_ATTRIBUTE = "_amp8_activation_storage"
"""The attribute of a module that holds its ``ActivationStorage`` (``amp8.nn.activations``)."""

StorageKey = tuple[str, int]


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """``(device, address)`` of the storage under ``tensor`` (shared by all its views)."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def persistent_storages(model: nn.Module | None) -> frozenset[StorageKey]:
    """The storages of ``model``'s parameters and buffers (none without a model)."""
    if model is None:
        return frozenset()
    tensors = [p._data if isinstance(p, ScaledWeight) else p for p in model.parameters()]  # a stored weight's storage
    return frozenset(storage_key(t) for t in [*tensors, *model.buffers()] if t.device.type != "meta")


_COPY_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "ReshapeAliasBackward0", "UnsafeViewBackward0", "ExpandBackward0", "CloneBackward0",
})
"""Autograd nodes of casts and layout changes: a chain of them from a parameter gives a
copy of that parameter (autocast's lower-precision weights)."""


def is_parameter_copy(tensor: torch.Tensor, parameters: frozenset[StorageKey]) -> bool:
    """Whether ``tensor`` is a cast or layout change of one leaf whose storage is in
    ``parameters`` (see ``persistent_storages``), such as the BF16 weight autocast hands
    a matmul: it is the same for every batch, not an activation."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in _COPY_NODES:
        inputs = [next_node for next_node, _ in node.next_functions if next_node is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    leaf = getattr(node, "variable", None)
    return isinstance(leaf, torch.Tensor) and storage_key(leaf) in parameters


@dataclass
class SavedBytes:
    """What autograd saved for backward while a ``count_saved_bytes`` block ran.

    Attributes:
        bytes: bytes of the distinct storages saved (FP8 data and scales where amp8
            stored a tensor in FP8).
        tensors: tensors packed, counting each view (also those not counted in bytes).
        by_dtype: ``bytes`` split by the stored dtype's name ("float32", "float8_e4m3fn", ...).
        persistent_skipped: packed tensors that are views of parameters or buffers.
        parameter_copy_bytes: bytes of saved copies of parameters (see
            ``is_parameter_copy``: autocast's casts of weights), not in ``bytes``: they
            do not grow with the batch.
    """

    bytes: int = 0
    tensors: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    persistent_skipped: int = 0
    parameter_copy_bytes: int = 0
    _excluded: frozenset[StorageKey] = field(default=frozenset(), repr=False)
    _seen: dict[StorageKey, torch.UntypedStorage] = field(default_factory=dict, repr=False)

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``, as it is kept for backward, unless its storage is a
        parameter's or buffer's or was counted already."""
        self.tensors += 1
        key = storage_key(tensor)
        if key in self._excluded:
            self.persistent_skipped += 1
            return
        if key in self._seen:
            return
        storage = tensor.untyped_storage()
        self._seen[key] = storage  # held, so a freed address is not reused while counting
        if is_parameter_copy(tensor, self._excluded):
            self.parameter_copy_bytes += storage.nbytes()
            return
        self.bytes += storage.nbytes()
        name = short_name(tensor.dtype) or str(tensor.dtype)
        self.by_dtype[name] = self.by_dtype.get(name, 0) + storage.nbytes()

    def per_token(self, tokens: int) -> float:
        """``bytes`` per token of a batch of ``tokens`` tokens.

        Raises:
            ValueError: ``tokens`` is not an int >= 1.
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"per_token(tokens={tokens!r}) is not valid; use the batch's token count, an int >= 1")
        return self.bytes / tokens

    def release(self) -> None:
        """Drop the references that keep counted storages' addresses unique."""
        self._seen = {}


def _unpack_as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def count_saved_bytes(model: nn.Module | None = None) -> Iterator[SavedBytes]:
    """Count the bytes autograd saves for backward inside the block; yields a
    ``SavedBytes`` that is complete when the block ends.

    Wrap one training step's forward (``with count_saved_bytes(model) as saved: loss =
    model(x)...``) to measure activation memory. Parameters and buffers of ``model`` are
    not counted. A model whose saved tensors amp8 stores in FP8 reports each stored
    tensor's FP8 bytes. The saved tensors are stored and restored as usual, so the
    backward of the counted step runs unchanged.

    Raises:
        TypeError: ``model`` is neither None nor an ``nn.Module``.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(
            f"amp8.count_saved_bytes takes the model (a torch.nn.Module) whose parameters and "
            f"buffers are not counted, or None; got {type(model).__name__}"
        )
    saved = SavedBytes(_excluded=persistent_storages(model))
    storages = [] if model is None else activation_storages(model)
    for storage in storages:
        storage.meters.append(saved)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(tensor)
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_as_is):
            yield saved
    finally:
        for storage in storages:
            storage.meters.remove(saved)
        saved.release()


class MeteredStorage(Protocol):
    """What ``count_saved_bytes`` needs of an activation storage
    (``amp8.nn.activations.ActivationStorage``): the meters it reports stored bytes to."""

    meters: list["SavedBytes"]


def activation_storages(model: nn.Module) -> list[MeteredStorage]:
    """The FP8 activation storages amp8 attached to ``model`` or its submodules (read by
    attribute, so this module need not import the one that attaches them)."""
    found = [module.__dict__.get(STORAGE_ATTRIBUTE) for module in model.modules()]
    return [storage for storage in found if storage is not None]
