"""``LowBitAdam``'s side of data parallelism: the attached gradient average (the optimizer
only calls it) and the rows of weights that FSDP2 shards over ranks, whose master weights
and moments each rank keeps at O3."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from amp8.optim.gradients import GradientAverage
from amp8.tensor.scaled import local_tensor
from amp8.tensor.stored import StoredWeight, float_grad


class DataParallel:
    """The data-parallel methods of ``LowBitAdam`` (see its class docstring)."""

    level: Any
    weights: dict[nn.Parameter, StoredWeight]
    param_groups: list[dict[str, Any]]
    _average: GradientAverage | None
    _stepped: bool

    def attach_gradient_average(self, average: GradientAverage) -> None:
        """Have ``average`` average this optimizer's gradients over data-parallel ranks:
        each step synchronizes it first, skips on every rank when any rank has a
        non-finite gradient, and ends its round last. ``amp8.initialize`` attaches an
        ``amp8.distributed.GradientReduction``; for an optimizer built by hand use
        ``amp8.distributed.GradientReduction.attach``. Attaching the attached one again
        does nothing.

        Raises:
            TypeError: ``average`` lacks a method of ``GradientAverage``.
            RuntimeError: another average is attached already, or the optimizer has taken
                a step (the ranks' weights may differ already).
            ValueError: the opt level shards the optimizer (O3) and an FP8 layer's weight
                is not sharded over the ranks.
        """
        if average is self._average:
            return
        if not isinstance(average, GradientAverage):
            raise TypeError(
                f"attach_gradient_average takes an amp8.optim.gradients.GradientAverage (such as "
                f"amp8.distributed.GradientReduction), got {type(average).__name__}"
            )
        if self._average is not None:
            raise RuntimeError(
                f"this LowBitAdam's gradients are averaged by a {type(self._average).__name__} "
                "already; attach one average per optimizer"
            )
        if self._stepped:
            raise RuntimeError(
                "attach the gradient average before the optimizer's first step: the ranks "
                "have stepped on gradients of their own since, and their weights may differ"
            )
        if self.level.shard_optimizer:
            self._check_all_sharded()
        self._average = average

    @property
    def gradient_average(self) -> GradientAverage | None:
        """What averages the gradients over data-parallel ranks (see
        ``attach_gradient_average``), or None."""
        return self._average

    @property
    def sharded(self) -> bool:
        """Whether FP8 layers' master weights and moments are sharded over ranks: the
        opt level shards the optimizer and FSDP2 shards the weights."""
        return self.level.shard_optimizer and any(handle.sharded for handle in self.weights.values())

    def _is_sharded(self, param: nn.Parameter) -> bool:
        handle = self.weights.get(param)
        return self.level.shard_optimizer and handle is not None and handle.sharded

    def _check_all_sharded(self) -> None:
        """Raise unless every FP8 layer's weight (but fixed-storage tables) is sharded."""
        unsharded = [p for p, handle in self.weights.items() if not (handle.sharded or handle.fixed_storage)]
        if unsharded:
            raise ValueError(
                f"opt level {self.level.name} in data parallel keeps each rank's rows of the FP8 "
                f"weights, but an FP8 layer's weight of shape {tuple(unsharded[0].shape)} is "
                "not sharded; let amp8.initialize build the optimizer, or shard the weights "
                "with amp8.distributed.fsdp.shard_weights first"
            )

    def no_sync(self) -> ContextManager[None]:
        """Context for the backward passes of gradient-accumulation micro-batches except
        the last: they start no communication (as ``DistributedDataParallel.no_sync``)."""
        return self._average.no_sync() if self._average is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Average every gradient over the data-parallel ranks (see
        ``attach_gradient_average``). ``step`` calls this when needed; call it yourself
        before anything that must see averaged gradients, such as clipping."""
        if self._average is not None:
            self._average.synchronize()

    def _sharded_average(self) -> GradientAverage:
        """The attached average, which the weights sharded over ranks need (their
        gradients and scales come from all ranks)."""
        if self._average is None:
            raise RuntimeError(
                "this LowBitAdam keeps each rank's rows of FP8 weights that FSDP2 shards over "
                "data-parallel ranks, and no gradient average is attached to it: before the first "
                "step call amp8.distributed.GradientReduction.attach(optimizer, "
                "amp8.distributed.data_parallel_group(model)), or let amp8.initialize build the optimizer"
            )
        return self._average

    def _own_chunk(self, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` whose state this rank keeps: all of it, or for a sharded
        weight this rank's rows, flat (``value`` must hold those rows already, as a
        sharded ``StoredWeight.read`` returns them)."""
        if not self._is_sharded(param):
            return value
        rows = local_tensor(param)
        if value.numel() != rows.numel():
            raise ValueError(
                f"the weight of shape {tuple(param.shape)} is sharded over data-parallel ranks and "
                f"this rank holds {rows.numel()} of its elements, but its master weight has "
                f"{value.numel()}; pass this rank's rows in master_weights"
            )
        return value.flatten()

    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """The float32 gradient of ``param``: its FP8 weight gradient or ``param.grad``
        (this rank's chunk of the averaged gradient for a sharded weight)."""
        if self._is_sharded(param):
            return self._sharded_average().averaged_chunk(param)
        return float_grad(param)
