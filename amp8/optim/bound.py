"""Adam's bound on the size of one step, to which a step over low-bit moments is held.

With exact arithmetic, Adam cannot move a weight by more than a bounded multiple of the
learning rate, whatever the gradients: by Cauchy-Schwarz over the moving averages
``m_t = (1 - b1) sum_k b1**k g_{t-k}`` and ``v_t = (1 - b2) sum_k b2**k g_{t-k}**2``,

    |m_t| <= (1 - b1) * sqrt(S_t / (1 - b2)) * sqrt(v_t),   S_t = sum_{k<t} (b1**2 / b2)**k,

so ``|m_t| / (sqrt(v_t) / sqrt(1 - b2**t)) <= (1 - b1) * sqrt(S_t * (1 - b2**t) / (1 - b2))``
at step ``t``. With bias correction, a step moves a weight by at most the learning rate
times that over ``1 - b1**t``: with torch's default betas 1.0 at the first step, 2.2 after
100 steps, 5.8 after 1000, never more than 7.3 (a gradient that is zero but for one
spike comes nearest). Stored moments break that link: an FP16 second moment that
flushes to zero, or an FP8 first moment rounded stochastically up from far below its
smallest subnormal, gives ``m / (sqrt(v) + eps)`` of thousands. ``LowBitAdam`` clamps that
ratio at the bound (times ``SLACK``, which leaves the rounding of healthy moments alone),
so a step with low-bit moments never moves a weight further than exact Adam could.
"""

from __future__ import annotations

import math

import torch

SLACK = 1.25
"""How far past the exact bound a stored pair of moments may go before it is clamped:
above E4M3's largest relative rounding step (1/8, which a stochastically rounded first
moment may take) and FP16's (1/2048 on the second moment)."""


def ratio_bound(beta1: float, beta2: float, step: float) -> float:
    """The largest ``|m| / (sqrt(v) / sqrt(1 - beta2**step))`` that exact Adam can reach at
    step ``step`` (1 for the first), times ``SLACK``; see the module docstring."""
    if beta2 == 0:  # v_t = g_t**2 alone, while m_t remembers earlier gradients: no bound
        return math.inf
    r = beta1**2 / beta2
    terms = step if r == 1 else (1 - r**step) / (1 - r)
    return SLACK * (1 - beta1) * math.sqrt(terms * (1 - beta2**step) / (1 - beta2))


def held_to_bound(exp_avg: torch.Tensor, denom: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """``exp_avg`` clamped to ``[-bound * denom, bound * denom]``, so that ``exp_avg / denom``
    (the step in learning rates, before bias correction) is at most ``bound``
    (``ratio_bound``'s). Unchanged, bit for bit, where it is within: the reference and the
    fused step divide the result as they divided ``exp_avg``."""
    limit = denom * bound
    return torch.minimum(torch.maximum(exp_avg, -limit), limit)
