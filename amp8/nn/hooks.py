"""The forward hooks amp8 registered on a module, found (and removed) by their owner."""

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


def forward_pre_hook_owners(module: nn.Module) -> list[object]:
    """The objects whose bound methods are ``module``'s forward pre-hooks (their
    ``__self__``), in the order the hooks run."""
    owners = (getattr(hook, "__self__", None) for hook in module._forward_pre_hooks.values())
    return [owner for owner in owners if owner is not None]
