"""The stand-ins that take a stored weight's gradient out of backward where its
Parameter cannot.

Backward returns each FP8 weight gradient (a ``WeightGrad``) to autograd as the gradient
of the weight Parameter itself. Two stand-ins take it where the Parameter cannot (see
``SingleStoredWeightModule._grad_target``):

- the **grad sink** of a weight FSDP2 shards (``grad_sink``): a leaf whose hook hands the
  gradient to the weight's ``StoredWeight`` handle, since FSDP2 would reduce a ``.grad``
  in its own dtype;
- the **gradient bridge** of a compiled graph (``grad_bridge``): a tensor whose backward,
  run eagerly, passes the gradient on to the Parameter.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from amp8.tensor.stored import StoredWeight
from amp8.tensor.stored_grad import requiring_grad
from amp8.tensor.weight_grad import GradLayout, WeightGrad, WeightGradInFlight


def grad_sink(handle: StoredWeight) -> torch.Tensor:
    """A zero ``WeightGradInFlight`` leaf of ``handle``'s weight shape (FSDP2's sharded
    Parameter reports the whole shape) that takes the weight's gradient from backward in
    place of the Parameter, and hands it to ``handle.add_grad``: a weight FSDP2 shards
    must not get a ``.grad``, which FSDP2 would reduce in its own dtype."""
    weight = handle.param
    sink = WeightGradInFlight.zeros(tuple(weight.shape), handle.grad_layout, weight.dtype, weight.device)
    sink.requires_grad_(True)
    sink.register_post_accumulate_grad_hook(functools.partial(_take_sink_grad, weakref.ref(handle)))
    return sink


def _take_sink_grad(handle: "weakref.ref[StoredWeight]", sink: torch.Tensor) -> None:
    """The grad sink's hook: move the gradient it took to ``handle`` (held weakly: the
    sink must not keep a layer's weight alive)."""
    grad, sink.grad = sink.grad, None
    stored = handle()
    if stored is not None:
        stored.add_grad(grad)  # type: ignore[arg-type]


class _GradBridge(torch.autograd.Function):
    """``apply(weight, sink)``: a stand-in for ``weight`` (``sink``, an empty
    ``WeightGradInFlight``) whose gradient backward passes on to ``weight`` as a
    ``WeightGrad`` (see ``SingleStoredWeightModule._grad_target``)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return sink.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        return (grad.at_rest() if isinstance(grad, WeightGrad) else grad), None


def grad_bridge(weight: nn.Parameter, shape: tuple[int, ...], layout: GradLayout) -> torch.Tensor:
    """The gradient bridge of ``weight`` (its gradient of ``shape`` stored at ``layout``):
    built while ``weight`` requires grad (for a moment, if it does not now), so that it
    serves whenever the weight trains."""
    sink = WeightGradInFlight.zeros(shape, layout, weight.dtype, weight.device)
    with requiring_grad(weight):
        return _GradBridge.apply(weight, sink)
