"""What one parameter's update is, fixed between steps: the layouts of its stored tensors
(``amp8.quant.codec``) and which weight it writes. The reference step and the grouped step
both read it; a group holds parameters of one ``UpdateSpec``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from amp8.optim import state as state_storage
from amp8.optim.arithmetic import Decay, decay_of
from amp8.optim.state import MASTER, MOMENTS
from amp8.quant.codec import FLOAT32, Layout
from amp8.tensor.stored import StoredWeight
from amp8.tensor.stored_layout import FP16_LAYOUT
from amp8.tensor.weight_grad import GradLayout, WeightGrad

GradParts = tuple[torch.Tensor, torch.Tensor | None, GradLayout | None]
"""A gradient as stored: ``(data, scales, its GradLayout)``, or ``(float gradient, None,
None)``; ``grad_codec`` gives its codec layout (the gradient carries its GradLayout, so
reading thousands of gradients a step builds no layout object per gradient)."""


class StepKind(str, Enum):
    """Which path a parameter's update takes this step."""

    SKIP = "skip"  # no update: frozen, no gradient, or listed twice (updated where listed first)
    PLAIN = "plain"  # torch's fused Adam (float32 moments; amp8.optim.plain_step)
    SHARDED = "sharded"  # its rows of a weight sharded over ranks (the reference step)
    UPDATE = "update"  # an update group, or its own reference update


@dataclass
class StepInputs:
    """What each parameter's update is this step, in the optimizer's order: its kind
    and, for an ``UPDATE``, its stored gradient and its state (None for the others).
    Parallel lists, so that a step makes no Python object per parameter beyond what it
    reads."""

    params: list[nn.Parameter]
    kinds: list[StepKind]
    grads: list[GradParts | None]
    states: list[dict[str, Any] | None]


class WeightKind(str, Enum):
    """What the weight input is and what the step writes back."""

    PLAIN = "plain"  # a float parameter, written back as float32 values
    FP16_SCALED = "fp16_scaled"  # FP16 data * power-of-two scale, stochastic rounding
    MASTER = "master"  # FP16 master (stochastic) plus the FP8 weight encoded from it


@dataclass(frozen=True)
class UpdateSpec:
    """Everything about one tensor's update that is fixed between steps."""

    grad: Layout
    exp_avg: Layout
    exp_avg_sq: Layout
    weight: WeightKind
    decay: Decay
    maximize: bool
    bounded: bool  # low-bit moments: the step is held to Adam's bound (amp8.optim.bound)
    fp8_weight: Layout = FLOAT32  # MASTER: the FP8 weight's layout
    fp8_previous_scale: bool = False  # MASTER: its scales keep their shape (a zero amax keeps the old one)

    @property
    def weight_layout(self) -> Layout:
        """The layout of the weight the step reads and writes (the master at O3)."""
        return FLOAT32 if self.weight is WeightKind.PLAIN else FP16_LAYOUT

    @property
    def stochastic(self) -> bool:
        """Whether the update rounds anything stochastically (it then draws a noise key)."""
        return self.weight is not WeightKind.PLAIN or self.exp_avg.stream is not None


def stored_grad(param: nn.Parameter, handle: StoredWeight | None) -> GradParts | None:
    """``(data, scales, layout)`` of ``param``'s gradient as stored (FP8 with scales for an
    FP8 layer's weight, else ``param.grad`` as float), or None without one.

    Raises:
        RuntimeError: a sparse ``param.grad``, which Adam does not take.
    """
    if handle is not None:
        grad = param.grad
        if type(grad) is not WeightGrad or handle.sharded:
            scaled = handle.grad()
            if scaled is None:
                return None
            grad = WeightGrad(scaled, param.dtype, handle.grad_layout)
        data, scale, _ = grad.parts()
        return data, scale, grad.grad_layout
    grad = param.grad
    if grad is None:
        return None
    if grad.is_sparse:
        raise RuntimeError(
            f"amp8: LowBitAdam does not take sparse gradients, as torch's Adam does not; a parameter of "
            f"shape {tuple(param.shape)} has one (nn.Embedding(sparse=True) makes them). Use sparse=False, "
            "or give that parameter an optimizer of its own (torch.optim.SparseAdam)"
        )
    return grad, None, None


def grad_codec(grad: GradParts) -> Layout:
    """The codec layout of a gradient as ``stored_grad`` gives it."""
    data, _, layout = grad
    return FLOAT32 if layout is None else layout.codec(data.shape)


def update_spec(
    param: nn.Parameter, handle: StoredWeight | None, param_state: dict[str, Any], group: dict[str, Any],
    grad: GradParts,
) -> UpdateSpec:
    """The ``UpdateSpec`` of ``param``'s update, given its ``stored_grad``: the layouts
    saved in its state."""
    if MASTER in param_state:
        kind = WeightKind.MASTER
    elif handle is not None:
        kind = WeightKind.FP16_SCALED
    else:
        kind = WeightKind.PLAIN
    fp8_layout, fp8_previous = FLOAT32, False
    if kind is WeightKind.MASTER:
        assert handle is not None
        fp8_layout = handle.layout
        fp8_previous = handle.stored_scale.shape == fp8_layout.amaxes(torch.empty(handle.data.shape, device="meta")).shape
    exp_avg, exp_avg_sq = (state_storage.layout_of(param_state, key) for key in MOMENTS)
    return UpdateSpec(
        grad=grad_codec(grad), exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, weight=kind, decay=decay_of(group),
        maximize=bool(group["maximize"]), bounded=exp_avg.scaled or exp_avg_sq.scaled,
        fp8_weight=fp8_layout, fp8_previous_scale=fp8_previous,
    )
