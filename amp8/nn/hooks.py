"""Removing the forward hooks amp8 registered on a module, found by their owner."""

from __future__ import annotations

from typing import Callable

from torch import nn


def remove_forward_hooks(module: nn.Module, owned: Callable[[object], bool]) -> None:
    """Remove ``module``'s forward pre-hooks and forward hooks that are bound methods of
    an object ``owned`` accepts (their ``__self__``). The handles registration returned
    refer to the hook dicts of the module they were registered on, so a copy of the
    module (``copy.deepcopy``) is searched instead."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [key for key, hook in hooks.items() if owned(getattr(hook, "__self__", None))]:
            del hooks[key]
            module._forward_hooks_always_called.pop(key, None)
