"""Adam's arithmetic, shared by ``LowBitAdam``'s reference step and its grouped step:
the coefficients of a step (computed on the device from the step count, so a skipped
step needs no host to know of it), the update of float32 values, and the bounds on the new
values' absolute maxima that give per-tensor scales before any new value exists (one pass
over the stored tensors instead of two).

Hyperparameters (``Hyper``) are Python floats for an eager step, which then runs torch's
own single-tensor Adam operations (FP32 moments match ``torch.optim.Adam`` bit for bit),
or 0-d float32 CPU tensors for a compiled one (one graph serves every learning rate).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, NamedTuple, Union

import torch

from amp8.optim.bound import SLACK, held_to_bound

Scalar = Union[float, torch.Tensor]


class Decay(str, Enum):
    """How weight decay enters the step."""

    NONE = "none"
    L2 = "l2"  # Adam: added to the gradient
    DECOUPLED = "decoupled"  # AdamW: the weight shrinks


def decay_of(group: dict[str, Any]) -> Decay:
    """How weight decay enters the steps of a param ``group``."""
    if group["weight_decay"] == 0:
        return Decay.NONE
    return Decay.DECOUPLED if group["decoupled_weight_decay"] else Decay.L2


class Hyper(NamedTuple):
    """A param group's hyperparameters as the step uses them, each computed in float64
    on the host as torch's Adam computes it."""

    lr: Scalar
    beta1: Scalar
    beta2: Scalar
    one_minus_beta1: Scalar
    one_minus_beta2: Scalar
    eps: Scalar
    decay: Scalar  # 1 - lr * weight_decay (decoupled) or weight_decay (L2)


def hyper(group: dict[str, Any], as_tensors: bool) -> Hyper:
    """``group``'s ``Hyper``: floats, or 0-d float32 CPU tensors (``as_tensors``: each
    float rounded to float32 as an eager operation rounds it, for the compiled step's
    elementwise arithmetic; ``step_scalars`` takes the floats)."""
    lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
    weight_decay = group["weight_decay"]
    decay = 1 - lr * weight_decay if group["decoupled_weight_decay"] else weight_decay
    values = (lr, float(beta1), float(beta2), 1 - float(beta1), 1 - float(beta2), float(eps), float(decay))
    if not as_tensors:
        return Hyper(*values)
    return Hyper(*(torch.tensor(value, dtype=torch.float32) for value in values))


class StepScalars(NamedTuple):
    """The coefficients of step number ``step`` (1 for the first), 0-d float32 tensors on
    the step count's device, each computed in float64 as torch's Adam computes it."""

    neg_step_size: torch.Tensor  # -lr / (1 - beta1**step)
    bias_correction2_sqrt: torch.Tensor  # (1 - beta2**step) ** 0.5
    ratio_bound: torch.Tensor  # amp8.optim.bound.ratio_bound(beta1, beta2, step)


def step_scalars(h: Hyper, step: torch.Tensor) -> StepScalars:
    """The ``StepScalars`` of step number ``step`` (a 0-d tensor on the step's device)
    under float hyperparameters ``h``, with ``amp8.optim.bound.ratio_bound``'s formula
    written in tensor operations: a dozen operations on one number, outside any compiled
    graph (a float64 hyperparameter would make its guards read it)."""
    t = step.double()
    lr, beta1, beta2 = h.lr, h.beta1, h.beta2
    neg_step_size = -(lr / (1 - torch.pow(beta1, t)))
    correction2 = 1 - torch.pow(beta2, t)
    if isinstance(beta2, torch.Tensor):
        r = beta1 * beta1 / beta2
        terms = torch.where(r == 1, t, (1 - torch.pow(r, t)) / (1 - r))
        bound = SLACK * h.one_minus_beta1 * torch.sqrt(terms * correction2 / h.one_minus_beta2)
        bound = torch.where(beta2 == 0, math.inf, bound)
    elif beta2 == 0:  # v_t = g_t**2 alone, while m_t remembers earlier gradients: no bound
        bound = torch.full_like(t, math.inf)
    else:
        r = beta1 * beta1 / beta2
        terms = t if r == 1 else (1 - torch.pow(r, t)) / (1 - r)
        bound = SLACK * h.one_minus_beta1 * torch.sqrt(terms * correction2 / h.one_minus_beta2)
    return StepScalars(neg_step_size.float(), correction2.sqrt().float(), bound.float())


def adam_arithmetic(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, weight: torch.Tensor,
    h: Hyper, s: StepScalars, *, decay: Decay, maximize: bool, bounded: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's new ``(exp_avg, exp_avg_sq, weight)`` from float32 values of any shape
    (elementwise: one tensor, or many in one buffer); ``bounded`` holds the step to Adam's
    bound (``amp8.optim.bound``; for low-bit moments). With float hyperparameters these are
    the operations of ``torch.optim.Adam(foreach=False)`` in its order; with tensor ones
    the same expressions, written out for ``torch.compile``."""
    if maximize:
        grad = -grad
    if decay is Decay.DECOUPLED:
        weight = weight * h.decay
    elif decay is Decay.L2:
        grad = _add_product(grad, weight, h.decay)
    exp_avg = torch.lerp(exp_avg, grad, h.one_minus_beta1)
    exp_avg_sq = _add_product(exp_avg_sq * h.beta2, grad, h.one_minus_beta2, grad)
    denom = torch.sqrt(exp_avg_sq) / s.bias_correction2_sqrt + h.eps
    numerator = held_to_bound(exp_avg, denom, s.ratio_bound) if bounded else exp_avg
    weight = weight + s.neg_step_size * numerator / denom
    return exp_avg, exp_avg_sq, weight


def _add_product(x: torch.Tensor, a: torch.Tensor, value: Scalar, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x + value * a`` (``* b``): torch's ``add(alpha=)`` / ``addcmul`` for a float
    ``value``, the expression for a tensor one."""
    if isinstance(value, float):
        return x.add(a, alpha=value) if b is None else torch.addcmul(x, a, b, value=value)
    return x + value * a if b is None else x + value * a * b


class AmaxBounds(NamedTuple):
    """Upper bounds on the absolute maxima of a step's new moments and weight."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    weight: torch.Tensor


def amax_bounds(
    grad_amax: torch.Tensor, exp_avg_amax: torch.Tensor, exp_avg_sq_amax: torch.Tensor, weight_amax: torch.Tensor,
    h: Hyper, s: StepScalars, decay: Decay,
) -> AmaxBounds:
    """Bounds on the new values' absolute maxima from the old ones' (elementwise over
    tensors): ``|m'| <= b1 |m| + (1 - b1) |g|``, ``v' <= b2 v + (1 - b2) g**2`` and
    ``|w'| <= |d| |w| + lr' * ratio_bound`` (a step moves a weight by at most Adam's bound,
    ``amp8.optim.bound``). A per-tensor scale taken from the bound needs no new value,
    so the step stores every tensor in the pass that computes it; the bound is at most a
    few tenths above the true amax, which costs the lowest values of an FP8 moment a fraction
    of a binade of range and an FP16 weight nothing (its scale is a power of two with a
    binade of headroom)."""
    if decay is Decay.L2:
        grad_amax = grad_amax + abs(h.decay) * weight_amax
    exp_avg = h.beta1 * exp_avg_amax + h.one_minus_beta1 * grad_amax
    exp_avg_sq = h.beta2 * exp_avg_sq_amax + h.one_minus_beta2 * grad_amax * grad_amax
    return AmaxBounds(exp_avg, exp_avg_sq, weight_bound(weight_amax, h, s, decay))


def weight_bound(weight_amax: torch.Tensor, h: Hyper, s: StepScalars, decay: Decay) -> torch.Tensor:
    """``amax_bounds``' bound on the new weight's absolute maximum from the old one's
    (elementwise: per tensor, or per row or block of a weight scaled so), which needs
    nothing of the gradient: ``|w'| <= |d| |w| + lr' * ratio_bound``."""
    shrink = (h.decay.abs() if isinstance(h.decay, torch.Tensor) else abs(h.decay)) if decay is Decay.DECOUPLED else 1.0
    return shrink * weight_amax + torch.abs(s.neg_step_size) * s.ratio_bound


def unless_skipped(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where ``skip`` (a bool on the device) is set: bit for bit,
    whatever the dtype (FP8 compared as bytes: ``where`` has no FP8 kernel)."""
    if skip is None:
        return new
    if old.element_size() == 1 and old.is_floating_point():
        return torch.where(skip, old.view(torch.uint8), new.view(torch.uint8)).view(old.dtype)
    return torch.where(skip, old, new.to(old.dtype))
