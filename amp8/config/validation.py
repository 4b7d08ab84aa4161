"""Argument checks shared by amp8's public functions."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def check_model_and_optimizer(caller: str, model: object, optimizer: object = None) -> None:
    """Raise ``TypeError`` unless ``model`` is an ``nn.Module`` and ``optimizer`` is None
    or a ``torch.optim.Optimizer``; the message names ``caller`` and what it got."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} takes the model (a torch.nn.Module) first, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{caller} takes the optimizer amp8.initialize returned (a torch.optim.Optimizer) or "
            f"None, got {type(optimizer).__name__}"
        )


def removed_name(owner: str, name: str, replacements: Mapping[str, str], *, module: bool = False) -> Exception:
    """The error for ``owner.name`` where ``owner`` (a module, or an object's class) has
    no ``name``: for one of amp8's removed names (``replacements`` maps each to what
    replaces it) an error naming the replacement, an ``ImportError`` for a module's
    (which ``from module import name`` passes on with its message); else the
    ``AttributeError`` Python gives."""
    if name in replacements:
        return (ImportError if module else AttributeError)(f"{owner}.{name} was removed: {replacements[name]}")
    return AttributeError(f"module {owner!r} has no attribute {name!r}" if module
                          else f"{owner!r} object has no attribute {name!r}")
