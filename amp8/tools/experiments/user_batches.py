"""The user's batches in ``amp8.compare(model=..., data=...)``: passes over them from the
start, their tensors moved to the run's device, their samples and tokens counted, a cheap
fingerprint of each (to tell when a level saw other batches than O0), and the loss of a
model on one."""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Iterator

import torch
from torch import nn

from amp8.tools.experiments.user_config import describe_callable

_FINGERPRINT_ELEMENTS = 16
"""Elements of each tensor of a batch summed into the batch's fingerprint."""


def fresh_pass(data: Any, name: str = "data") -> Iterator[Any]:
    """One pass over ``data`` from its start: iterate it again, or call it when it is a
    function that returns the batches.

    Raises:
        TypeError: the function returned an iterator that was already read, or something
            not iterable.
    """
    source = data() if callable(data) and not isinstance(data, collections.abc.Iterable) else data
    if not isinstance(source, collections.abc.Iterable) or isinstance(source, nn.Module):
        raise TypeError(f"{name}() returned a {type(source).__name__}, not an iterable of batches")
    return iter(source)


def steps_of(data: Any, steps: int) -> Iterator[Any]:
    """``steps`` batches of ``data``, reading it again from the start when a pass ends.

    Raises:
        ValueError: a pass yielded no batch, naming which pass.
    """
    step = 0
    while True:
        empty = True
        for batch in fresh_pass(data):
            empty = False
            yield batch
            step += 1
            if step == steps:
                return
        if empty:
            again = ("" if step == 0 else
                     f" on its pass after {step} batches (a function that returns the same iterator each time?)")
            raise ValueError(
                f"data yielded no batches{again}; every run reads it from the start, so give a list, a "
                "DataLoader or a function that returns a fresh iterable with at least one batch"
            )


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (in tuples, lists and mappings, nested) on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, collections.abc.Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``batch``, depth first."""
    if torch.is_tensor(batch):
        yield batch
    elif isinstance(batch, collections.abc.Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def count_items(batch: Any) -> tuple[int | None, int | None]:
    """The samples and tokens of ``batch``: its ``input_ids``' rows and elements when it is
    a mapping that has them; else the first tensor's first dimension, and no tokens."""
    if isinstance(batch, collections.abc.Mapping) and torch.is_tensor(batch.get("input_ids")):
        ids = batch["input_ids"]
        return (ids.shape[0] if ids.dim() else 1), ids.numel()
    first = next(_tensors(batch), None)
    if first is None:
        return None, None
    return (first.shape[0] if first.dim() else 1), None


def fingerprint(batch: Any) -> torch.Tensor:
    """A cheap fingerprint of ``batch``: per tensor, the sum of its first few elements
    (float64, on the tensor's device); equal batches give equal fingerprints."""
    parts = [t.detach().flatten()[:_FINGERPRINT_ELEMENTS].double().sum() for t in _tensors(batch)]
    return torch.stack(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)


def compute_loss(loss_fn: Callable[[nn.Module, Any], Any] | None, model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or without one
    ``model(**batch).loss`` for a mapping and ``model(batch)`` (its ``.loss`` when it has
    one) otherwise.

    Raises:
        TypeError: the loss is not a tensor, saying how to give one.
        ValueError: the loss is not a scalar, saying how to reduce it.
    """
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        source = f"loss={describe_callable(loss_fn)}"
    else:
        output = model(**batch) if isinstance(batch, collections.abc.Mapping) else model(batch)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, collections.abc.Mapping):
            loss = output.get("loss")
        loss = output if loss is None else loss
        source = "the model's output (no loss= given)"
    fix = "pass loss=lambda model, batch: <a scalar tensor>, e.g. F.cross_entropy(model(batch[0]), batch[1])"
    if not torch.is_tensor(loss):
        raise TypeError(f"{source} is a {type(loss).__name__}, not a scalar loss tensor; {fix}")
    if loss.numel() != 1:
        raise ValueError(
            f"{source} is a tensor of shape {tuple(loss.shape)}, not a scalar loss; reduce it (.mean(), .sum()) "
            f"or {fix}"
        )
    return loss.reshape(())
