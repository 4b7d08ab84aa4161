"""``GradientReduction``: one optimizer's gradients averaged over data-parallel ranks,
FP8 on the wire.

``amp8.initialize`` attaches one to the optimizer it returns in a process group
(``GradientReduction.attach``): it averages the optimizer's parameters, and the optimizer
calls it through ``amp8.optim.gradients.GradientAverage``, which it implements. The
gradients tell it when they are final (a stored weight's grad-ready hook, any other
parameter's post-accumulate-grad hook), and each bucket's FP8 all-to-all starts during
backward; the optimizer only calls ``synchronize()`` before its step and reads the
averaged gradients. Replicated gradients are replaced by their mean in place (an FP8
weight gradient is re-stored once from it); a sharded weight (O3) keeps only this rank's
rows of the mean, here, for the optimizer. Once the user's DDP is registered
(``amp8.distributed.register_ddp``), DDP averages the other parameters and this reduction the FP8
weights alone; under its ``find_unused_parameters=True`` when that backward ends, as
ranks may leave different weights without a gradient. Delayed-scaling histories are made
equal on every rank at the end of each round, so every rank casts with the same scales.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from amp8.distributed.buckets import GradientBuckets
from amp8.distributed.data_parallel import DataParallelGroup, agree_on_delayed_scales
from amp8.optim.adam import LowBitAdam
from amp8.tensor.stored import StoredWeight, float_grad, stored_weight


class GradientReduction:
    """Averages the gradients of ``params`` over the ranks of ``data_parallel`` (an
    ``amp8.optim.gradients.GradientAverage``; ``attach`` builds one for an optimizer).

    Args:
        data_parallel: the process group and its byte counter.
        params: every parameter of one optimizer, in its order (the same on every rank).
        overlap: start each bucket's all-to-all during backward, as soon as its gradients
            are final (else all of them in ``synchronize``).
    """

    def __init__(self, data_parallel: DataParallelGroup, params: list[nn.Parameter], *, overlap: bool = True) -> None:
        self.data_parallel = data_parallel
        self.params = list(params)
        self.weights: dict[nn.Parameter, StoredWeight] = {
            param: handle for param in self.params if (handle := stored_weight(param)) is not None
        }
        self._chunks: dict[nn.Parameter, torch.Tensor] = {}
        self._synchronized = False
        self._buckets: GradientBuckets | None = None
        self._buckets_under: Any = None  # the DDP the buckets were built for (None: none)
        self.hook_handles: list[RemovableHandle] = []
        if overlap:
            self._register_hooks()
        data_parallel.at_backward_end.append(self.synchronize)

    @classmethod
    def attach(
        cls, optimizer: LowBitAdam, data_parallel: DataParallelGroup, *, overlap: bool = True
    ) -> "GradientReduction":
        """Average ``optimizer``'s gradients over ``data_parallel``: a reduction over its
        parameters, in order, attached with ``optimizer.attach_gradient_average``;
        returns it. ``amp8.initialize`` calls this in a process group; for a
        ``LowBitAdam`` built by hand over a model ``amp8.initialize`` returned there,
        call it with that model's group, ``amp8.distributed.data_parallel_group(model)``,
        before the first step.

        Args:
            optimizer: the ``LowBitAdam``, on every rank.
            data_parallel: the process group and its byte counter.
            overlap: start each bucket's FP8 all-to-all during backward, as soon as its
                gradients are final (else all of them at ``step``).

        Raises:
            TypeError: ``optimizer`` is not a ``LowBitAdam`` or ``data_parallel`` not a
                ``DataParallelGroup``.
            RuntimeError, ValueError: what ``LowBitAdam.attach_gradient_average`` raises
                (the reduction's hooks are removed again).
        """
        if not isinstance(optimizer, LowBitAdam):
            raise TypeError(
                f"GradientReduction.attach takes an amp8.optim.LowBitAdam, got {type(optimizer).__name__}"
            )
        if not isinstance(data_parallel, DataParallelGroup):
            raise TypeError(
                "GradientReduction.attach takes an amp8.distributed.DataParallelGroup (the model's: "
                f"amp8.distributed.data_parallel_group(model)), got {type(data_parallel).__name__}"
            )
        params = [param for group in optimizer.param_groups for param in group["params"]]
        reduction = cls(data_parallel, params, overlap=overlap)
        try:
            optimizer.attach_gradient_average(reduction)
        except BaseException:
            reduction.remove()
            raise
        return reduction

    def remove(self) -> None:
        """Stop listening: remove the hooks this reduction registered (on the gradients
        and at the end of backward)."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        if self.synchronize in self.data_parallel.at_backward_end:
            self.data_parallel.at_backward_end.remove(self.synchronize)

    def is_sharded(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is a weight FSDP2 shards (its gradient is reduce-scattered)."""
        handle = self.weights.get(param)
        return handle is not None and handle.sharded

    # -- what each rank's backward left ----------------------------------------------
    def local_gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient as this rank's backward left it, in float32."""
        return float_grad(param)

    def _has_local_gradient(self, param: nn.Parameter) -> bool:
        handle = self.weights.get(param)
        return (handle.grad() if handle is not None else param.grad) is not None

    # -- the round: hooks during backward, then synchronize ---------------------------
    @property
    def buckets(self) -> GradientBuckets:
        """The gradient buckets: every gradient, or only the FP8 weights' once the user's
        DDP (which averages the others) is registered."""
        ddp = self.data_parallel.ddp
        if self._buckets is None or self._buckets_under is not ddp:
            covered = [p for p in self.params if ddp is None or p in self.weights]
            paused = self._buckets is not None and self._buckets.is_paused
            self._buckets = GradientBuckets(
                self.data_parallel, covered, self.local_gradient, self._has_local_gradient, self.is_sharded
            )
            self._buckets.is_paused = paused
            self._buckets_under = ddp
        return self._buckets

    def _register_hooks(self) -> None:
        for param in self.params:
            handle = self.weights.get(param)
            if handle is not None:
                # The hook gets the layer's weight as it is in backward: under FSDP2 the
                # gathered Parameter, not the sharded one the buckets know.
                hook = functools.partial(_notify_ready, self.grad_ready, param)
                self.hook_handles.append(handle.register_grad_ready_hook(hook))
            else:
                self.hook_handles.append(param.register_post_accumulate_grad_hook(self.grad_ready))

    def grad_ready(self, param: nn.Parameter) -> None:
        """``param``'s gradient of this backward is final: start its bucket if it is full
        (nothing for a parameter the user's DDP averages)."""
        if self.data_parallel.ddp is not None and param not in self.weights:
            return
        self._synchronized = False  # a backward after an average starts a new round
        if self.data_parallel.reduces_at_backward_end:
            return  # ranks may differ in which gradients come: all are reduced at the end
        buckets = self.buckets
        buckets.grad_ready(param)
        # Under the user's DDP, trainers clip right after backward, on DDP's averaged
        # gradients: average the FP8 weights' ones as soon as all their buckets are out.
        if self.data_parallel.ddp is not None and buckets.all_started:
            self.synchronize()

    def no_sync(self) -> ContextManager[None]:
        """Context for the backward passes of gradient-accumulation micro-batches except
        the last: they start no communication."""
        return self.buckets.paused()

    def synchronize(self) -> None:
        """Finish the round: every gradient averaged (see the module docstring), the
        delayed-scaling histories made equal. Does nothing when already done."""
        if self._synchronized:
            return
        means, chunks = self.buckets.finish()
        for param, mean in means.items():
            handle = self.weights.get(param)
            if handle is not None:
                handle.set_grad_from_float(mean.view(param.shape))
            else:
                param.grad = mean.view(param.shape).to(param.dtype)
        for param, chunk in chunks.items():
            self._chunks[param] = chunk
            self.weights[param].clear_grad()
        agree_on_delayed_scales(self.data_parallel, list(self.weights.values()))
        self._synchronized = True

    def averaged_chunk(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's rows of the averaged gradient of a sharded weight (flat float32),
        after ``synchronize``; None for any other parameter."""
        return self._chunks.get(param)

    def end_round(self) -> None:
        """Forget this round's averaged chunks: the next backward starts a new round."""
        self._chunks = {}
        self._synchronized = False

    def reset(self) -> None:
        """``zero_grad``: end the round and drop whatever is in flight."""
        self.end_round()
        self.buckets.reset()

    # -- agreement the optimizer needs ------------------------------------------------
    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        return self.data_parallel.any_rank(flag)

    def max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``values`` over the ranks."""
        return self.data_parallel.max_over_ranks(values)


def _notify_ready(grad_ready: Callable[[nn.Parameter], None], param: nn.Parameter, _weight: nn.Parameter) -> None:
    grad_ready(param)

