"""``GradientAverage``: what ``LowBitAdam`` asks of whatever averages its gradients over
data-parallel ranks.

The optimizer does Adam only. In data parallel an object that averages the gradients is
attached to it (``LowBitAdam.attach_gradient_average``; ``amp8.initialize`` attaches an
``amp8.distributed.GradientReduction``), and the step reads gradients and agrees with the
other ranks through these methods alone. The step calls them itself rather than through
torch's step hooks: a step pre-hook runs before the step's closure, whose backward makes
the gradients to average.
"""

from __future__ import annotations

from typing import ContextManager, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class GradientAverage(Protocol):
    """Averages one optimizer's gradients over data-parallel ranks, round by round: the
    backward passes up to a step, then ``synchronize``, the step, ``end_round``."""

    def synchronize(self) -> None:
        """Finish the round: every gradient averaged over the ranks, in ``param.grad``
        (an FP8 weight's in its ``StoredWeight``), except those of weights sharded over
        the ranks (see ``averaged_chunk``). Does nothing when already done; the step
        calls it before it checks the gradients."""

    def averaged_chunk(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's rows of the averaged gradient of a weight sharded over the ranks
        (flat float32), after ``synchronize``; None for any other parameter."""

    def no_sync(self) -> ContextManager[None]:
        """Context for the backward passes of gradient-accumulation micro-batches except
        the last: they start no communication."""

    def end_round(self) -> None:
        """Forget this round's averages: the next backward starts a new round. The step
        calls it last."""

    def reset(self) -> None:
        """End the round and drop whatever is in flight (``zero_grad`` calls it)."""

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank (a non-finite gradient
        anywhere makes every rank skip the step)."""

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``values`` over the ranks (the amaxes that give every rank's
        rows of a sharded weight one scale)."""
