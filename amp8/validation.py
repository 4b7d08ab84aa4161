"""Argument checks shared by amp8's public functions."""

from __future__ import annotations

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
