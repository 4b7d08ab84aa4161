"""``LowBitAdam``'s reference step: one parameter's update, one eager operation at a
time, through the storage codec (``amp8.quant.codec``). It is the specification the
grouped step (``amp8.optim.group_step``) is held to, bit for bit when that runs eagerly,
and the step of every tensor a group does not cover (tiles of scales, E8M0 scales, stacks
of experts, weights sharded over ranks).

Scales per tensor, row or block come from bounds on the new values' absolute maxima
(``amp8.optim.arithmetic.amax_bounds``), here from the old values themselves and the
gradient's (O3's FP8 weight's from its master's); scales per 2-D tile (which no update
group covers) from the new values. A skipped step (``skip``, a bool on the device) writes
back what it read and leaves the step count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp8.optim import state as state_storage
from amp8.optim.arithmetic import AmaxBounds, adam_arithmetic, amax_bounds, decay_of, hyper, step_scalars, weight_bound
from amp8.optim.spec import GradParts, grad_codec
from amp8.optim.state import MASTER, MOMENTS
from amp8.optim.stored_state import StoredState
from amp8.quant import noise, scaling
from amp8.quant.codec import Layout, Tiling


def grad_amax(grad: GradParts, values: torch.Tensor) -> torch.Tensor:
    """A bound on the gradient's amax: the largest value its format holds over each scale
    (NaN where its cast saw an inf or NaN), or the amax of a float gradient ``values``."""
    data, scale, _ = grad
    if scale is None:
        return scaling.amax(values)
    return (scaling.max_value(data.dtype) / scale.float()).amax()


def grad_amaxes(grad: GradParts, values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``grad_amax``'s bound over each of ``layout``'s scale groups (rows or blocks of a
    moment), in the shape of its scales: the largest value the gradient's format holds
    under each element's scale, or the float gradient ``values``' amaxes."""
    data, scale, _ = grad
    if scale is None:
        return layout.amaxes(values)
    # Each element's ``max_value / scale`` (``reciprocal * max_value``, as torch divides a
    # number by a tensor, and as the grouped step computes it), at any tiling of scales.
    reciprocals = grad_codec(grad).decode(torch.ones_like(data), scale)
    return layout.amaxes(reciprocals * scaling.max_value(data.dtype))


def reference_update(
    stored: StoredState, param: nn.Parameter, param_state: dict[str, Any], grad: GradParts,
    group: dict[str, Any], skip: torch.Tensor,
) -> None:
    """``param``'s Adam step from its stored ``grad`` under ``group``'s hyperparameters,
    written into its state and weight unless ``skip``."""
    grad_values = grad_codec(grad).decode(grad[0], grad[1])
    exp_avg, exp_avg_sq = (state_storage.load(param_state, key) for key in MOMENTS)
    weight = stored.weight(param, param_state)
    h, decay = hyper(group, as_tensors=False), decay_of(group)
    step = param_state["step"] + 1
    s = step_scalars(h, step)
    weight_amax = scaling.amax(weight)
    bounds = amax_bounds(grad_amax(grad, grad_values), scaling.amax(exp_avg), scaling.amax(exp_avg_sq),
                         weight_amax, h, s, decay)
    layouts = [stored.moment_layout(param, name) for name in MOMENTS]
    moment_bounds = [bounds.exp_avg, bounds.exp_avg_sq]
    row_bounds: dict[tuple[Tiling, int], AmaxBounds] = {}  # by scale grouping: both moments take one as a rule
    for index, layout in enumerate(layouts):
        if layout.scaled and layout.per_row:  # bounded row by row (block by block)
            grouping = (layout.tiling, layout.block)
            if grouping not in row_bounds:
                row_bounds[grouping] = amax_bounds(grad_amaxes(grad, grad_values, layout), layout.amaxes(exp_avg),
                                                   layout.amaxes(exp_avg_sq), weight_amax, h, s, decay)
            moment_bounds[index] = row_bounds[grouping][index]
    fp8_bound = None  # O3's FP8 weight under row or block scales: bounded row by row from its master's
    handle = stored.weights.get(param)
    if MASTER in param_state and handle is not None and handle.layout.per_row:
        fp8_bound = weight_bound(handle.layout.amaxes(weight), h, s, decay)
    exp_avg, exp_avg_sq, weight = adam_arithmetic(
        grad_values, exp_avg, exp_avg_sq, weight, h, s, decay=decay, maximize=bool(group["maximize"]),
        bounded=state_storage.low_bit_moments(param_state),
    )
    key = stored.update_noise_key(param)
    words = None if key is None else noise.update_words(noise.element_index(weight.shape, weight.device), key)
    for name, value, layout, bound in zip(MOMENTS, (exp_avg, exp_avg_sq), layouts, moment_bounds):
        scale = None
        if layout.per_tensor or (layout.scaled and layout.per_row):
            previous = param_state.get(name + state_storage.SCALE_SUFFIX)
            fits = previous is not None and previous.shape == bound.shape
            scale = layout.scales(bound, previous.float() if fits else None)
        stored.store_moment(param, param_state, name, value, words, scale, skip)
    stored.write_weight(param, param_state, weight, words, bounds.weight, skip, fp8_bound)
    param_state["step"].add_((~skip).float())
