"""How ``LowBitAdam``'s state dicts are told apart from torch's.

Low-bit state (FP8 ``exp_avg``, FP16 ``exp_avg_sq``, FP16 master weights, each beside its
scales) loaded into ``torch.optim.Adam`` would be cast to float32 without its scales and
step the model with moments off by their scales. So such a state dict carries one more,
empty param group that names what it holds: torch's ``load_state_dict`` refuses it
("a different number of parameter groups"), amp8's optimizer drops it, and
``to_torch_state_dict`` turns the state into what torch's Adam reads.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import OptLevel, Precision
from amp8.optim import state as state_storage
from amp8.optim.state import MOMENTS
from amp8.optim import layer_state
from amp8.quant.checks import check_loaded_scales

MARKER_KEY = "amp8_low_bit_state"


def has_low_bit_state(level: OptLevel) -> bool:
    """Whether an optimizer at ``level`` stores state torch's Adam would misread."""
    return level.exp_avg is not Precision.FP32 or level.exp_avg_sq is not Precision.FP32 or (
        level.master_weight is not None
    )


def with_marker(state_dict: dict[str, Any], level: OptLevel) -> dict[str, Any]:
    """``state_dict`` with the marker group appended (see the module docstring)."""
    marker = {
        "params": [],
        MARKER_KEY: (
            f"amp8 opt level {level.name}: moments and master weights stored low-bit with "
            "scales. Load this into the optimizer amp8.initialize returns, or convert it "
            "with amp8.optim.to_torch_state_dict for torch.optim.Adam/AdamW"
        ),
    }
    return {**state_dict, "param_groups": [*state_dict["param_groups"], marker]}


def without_marker(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` without amp8's marker group (unchanged where it has none)."""
    groups = [group for group in state_dict["param_groups"] if MARKER_KEY not in group]
    return {**state_dict, "param_groups": groups}


def to_torch_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An amp8 optimizer state dict (any opt level) as ``torch.optim.Adam`` / ``AdamW``
    load it: float32 moments, no scales, no marker group, no amp8 counters. O3's master
    weights are left out (torch's Adam keeps none): take the model's real weights from
    ``amp8.export(model, optimizer)`` before converting. O3 in data parallel keeps each
    rank's rows of the FP8 layers' state, which a plain optimizer cannot take: convert a
    checkpoint of one process."""
    state = {}
    for param_id, saved in state_dict["state"].items():
        converted = {"step": saved["step"]} if "step" in saved else {}
        for key in MOMENTS:
            if key in saved:
                converted[key] = state_storage.load(saved, key)
        state[param_id] = converted
    groups = without_marker(state_dict)["param_groups"]
    return {"state": state, "param_groups": [dict(group) for group in groups]}


def param_indices(param_groups: list[dict[str, Any]]) -> dict[nn.Parameter, int]:
    """Each parameter's index in a state dict, as torch's ``Optimizer.state_dict`` numbers
    them: its first place among all groups' parameters in order."""
    indices: dict[nn.Parameter, int] = {}
    for index, param in enumerate(param for group in param_groups for param in group["params"]):
        indices.setdefault(param, index)
    return indices


def merge_string_ids(state: dict[Any, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per-parameter state keyed by int id. torch.distributed.checkpoint loads tensors in
    place under the int ids and the other values under the ids as strings; merge both."""
    merged: dict[int, dict[str, Any]] = {}
    for param_id, saved in sorted(state.items(), key=lambda item: isinstance(item[0], int)):
        merged.setdefault(int(param_id), {}).update(saved)
    return merged


def restore_state(
    state: dict[nn.Parameter, dict[str, Any]],
    params: list[nn.Parameter],
    state_dict: dict[str, Any],
    convert: Callable[[nn.Parameter, dict[str, Any]], set[str]],
) -> set[str]:
    """Put each parameter's saved state into ``state`` exactly as saved (torch's loader
    would cast it to the parameter's dtype), after checking every saved scale and passing
    it through ``convert`` (state saved at other precisions); what ``convert`` changed."""
    # int() because torch.distributed.checkpoint hands the ids back as strings.
    saved_ids = [int(i) for group in state_dict["param_groups"] for i in group["params"]]
    by_id = dict(zip(saved_ids, params))
    converted: set[str] = set()
    for param_id, saved in merge_string_ids(state_dict["state"]).items():
        param = by_id[param_id]
        param_state = {
            key: value.detach().clone().to(param.device) if torch.is_tensor(value) else value
            for key, value in saved.items()
        }
        for key, value in param_state.items():
            if key.endswith(state_storage.SCALE_SUFFIX):
                check_loaded_scales(f"state[{param_id}][{key!r}]", value)
        converted |= convert(param, param_state)
        state[param] = param_state
    return converted


EXTRA_STATE_KEY = "amp8"
"""Where ``LowBitAdam.state_dict`` keeps amp8's counters, the rounding seed and the layers' state."""


class Checkpoints:
    """``LowBitAdam``'s ``state_dict`` and ``load_state_dict``."""

    level: OptLevel
    param_groups: list[dict[str, Any]]
    state: Any
    weights: dict[nn.Parameter, Any]
    stored: Any
    skipped_steps: int
    seed: int
    rounding_counter: int
    _drop_plan: Callable[[], None]

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus amp8's counters and the stochastic-rounding
        seed and count of draws (all the noise of the rest of the run depends on). Low-bit
        state carries a marker that makes ``torch.optim.Adam.load_state_dict`` refuse it
        (see ``amp8.optim.checkpoint``; ``amp8.optim.to_torch_state_dict`` converts)."""
        state = super().state_dict()  # type: ignore[misc]
        if has_low_bit_state(self.level):
            state = with_marker(state, self.level)
        state[EXTRA_STATE_KEY] = {
            "skipped_steps": self.skipped_steps,
            "rounding": {"seed": self.seed, "counter": self.rounding_counter},
            layer_state.LAYERS_KEY: layer_state.layer_states(self.weights, param_indices(self.param_groups)),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore exactly what ``state_dict()`` saved, the FP8 layers' state with it.

        torch's loader casts floating state to each parameter's dtype, which would round
        FP32 moments to FP16 and break FP8 ones; amp8 restores every tensor as saved. State
        saved at other precisions (another opt level) is converted to this optimizer's,
        with a warning that says so. Each FP8 layer takes back its amax histories, GEMM
        precision and weight scales, its weight re-encoded under those scales from the
        real values the model holds (``amp8.optim.layer_state``): after the model's plain
        ``state_dict`` (loaded before or after this), the run resumes bit for bit.
        """
        state_dict = without_marker(dict(state_dict))
        extra = state_dict.pop(EXTRA_STATE_KEY, {})
        self._drop_plan()
        params = [p for group in self.param_groups for p in group["params"]]
        layer_state.restore_layer_states(self.weights, params, extra.get(layer_state.LAYERS_KEY, {}))
        super().load_state_dict(state_dict)  # type: ignore[misc]
        converted = restore_state(self.state, params, state_dict, self.stored.convert)
        if converted:
            warnings.warn(
                f"amp8: the optimizer checkpoint was saved at other precisions; converted "
                f"{', '.join(sorted(converted))} to opt level {self.level.name}",
                stacklevel=2,
            )
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        rounding = extra.get("rounding")
        if rounding is not None:
            self.stored.seed, self.stored.rounding_counter = int(rounding["seed"]), int(rounding["counter"])
        elif "generators" in extra:
            warnings.warn(
                "amp8: the optimizer checkpoint holds torch.Generator states for stochastic "
                "rounding, from an amp8 before counter-based rounding; they are ignored and "
                f"rounding continues from seed {self.seed}, so the resumed run rounds with "
                "other random bits than the saved one would have (with the same statistics)",
                stacklevel=2,
            )
