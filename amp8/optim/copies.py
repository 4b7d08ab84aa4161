"""How ``LowBitAdam`` copies (``copy.deepcopy``, pickling), as torch's optimizers do.

torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and
``param_groups``; ``LowBitAdam`` keeps its options and counters too, and rebuilds the rest
against the copy's Parameters: the FP8 weights' handles, the state storage over them and
the layers whose state it saves (on first use, once the copied model's layers have bound
their handles: ``BOUND_TO_PARAMS``), fresh compiled steps and no update groups (their flat
buffers are built again at the next step, over the copied tensors). Hooks and the
attached gradient average are not copied. Copied with its model (``copy.deepcopy((model,
optimizer))``, or one ``torch.save`` of both), the optimizer's state is keyed by the
copied model's Parameters: the memo of the copy shares them.
"""

from __future__ import annotations

from typing import Any

import torch

from amp8.optim import layer_state
from amp8.optim.group_step import GroupSteps
from amp8.optim.state import MASTER
from amp8.optim.stored_state import StoredState
from amp8.optim.plan import UpdatePlan
from amp8.tensor.stored import stored_weight

# What a copy keeps; the rest is rebuilt.
_COPIED = frozenset({
    "defaults", "state", "param_groups", "level", "fused", "_fused_on_cpu", "grouped", "_skipped", "_stepped",
})
BOUND_TO_PARAMS = frozenset({"weights", "stored", "_layer_modules"})
"""Rebuilt on first use after a copy (``LowBitAdam.__getattr__`` calls ``_bind_to_params``)."""


class Copies:
    """``LowBitAdam``'s side of copying (see the module docstring)."""

    state: Any
    param_groups: list[dict[str, Any]]
    level: Any
    stored: StoredState

    def __getstate__(self) -> dict[str, Any]:
        """What a copy keeps (see the module docstring): torch's param groups, state and
        defaults, the options and counters, and the stochastic-rounding seed and count.
        The FP8 weights' handles, the update groups (views into flat buffers), compiled
        steps, hooks and the gradient average are rebuilt or dropped, not copied."""
        state = {name: value for name, value in self.__dict__.items() if name in _COPIED}
        stored = self.stored
        state["_stored_options"] = (stored.state_block_size, stored.seed, stored.rounding_counter)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from ``__getstate__``: what refers to the Parameters' handles is bound
        on first use (``_bind_to_params``), once the copied model's layers have bound them."""
        super().__setstate__(state)  # type: ignore[misc]
        if "_group_steps" not in self.__dict__:  # a copy (torch's load_state_dict calls this too)
            self._new_step_functions()
            self._average = None

    def _new_step_functions(self) -> None:
        """Fresh compiled steps and no update groups (built again at the next step)."""
        self._group_steps = {compiled: GroupSteps(compile=compiled) for compiled in (False, True)}
        self._plan: UpdatePlan | None = None

    def _bind_to_params(self) -> None:
        """After a copy: find the FP8 weights' handles from the (copied) Parameters, build
        the state storage over them, and give each state tensor memory of its own (the
        copy of an update group's flat buffer, which no group holds any more)."""
        state_block_size, seed, counter = self.__dict__.pop("_stored_options")
        params = list(dict.fromkeys(param for group in self.param_groups for param in group["params"]))
        self.weights = {param: handle for param in params if (handle := stored_weight(param)) is not None}
        self.stored = StoredState(
            self.level, self.weights, state_block_size, seed,
            self._own_chunk, self._is_sharded,  # type: ignore[attr-defined]
        )
        self.stored.rounding_counter = counter
        self._layer_modules = layer_state.fp8_layers(self.weights.values())
        for param_state in self.state.values():
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.untyped_storage().nbytes() != value.nbytes:
                    param_state[key] = value.clone()
        # O3: writes of the copied weights from outside land in the copy's master weights
        # (a copied handle holds no master writer).
        attach_master = getattr(self.stored, "attach_master", None)
        if attach_master is not None:
            for param in self.weights:
                if MASTER in self.state.get(param, {}):
                    attach_master(param, self.state[param])
