"""How ``LowBitAdam``'s state dicts are told apart from torch's.

Low-bit state (FP8 ``exp_avg``, FP16 ``exp_avg_sq``, FP16 master weights, each beside its
scales) loaded into ``torch.optim.Adam`` would be cast to float32 without its scales and
step the model with moments off by their scales. So such a state dict carries one more,
empty param group that names what it holds: torch's ``load_state_dict`` refuses it
("a different number of parameter groups"), amp8's optimizer drops it, and
``to_torch_state_dict`` turns the state into what torch's Adam reads.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from amp8.config.levels import OptLevel, Precision
from amp8.optim import state as state_storage
from amp8.optim.state import MOMENTS
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
