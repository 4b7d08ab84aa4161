"""Gradient buckets whose FP8 all-to-all starts during backward.

Parameters are grouped into buckets in reverse order (backward produces the last layers'
gradients first). Hooks call ``grad_ready(param)`` when a parameter's gradient for this
backward is complete; when every gradient of a bucket is ready and every earlier bucket has
been started, the bucket's reduce-scatter starts asynchronously, overlapping the rest of
backward. ``finish()`` (from ``optimizer.synchronize``) starts what is left in bucket
order and waits for everything.

As with DDP, every rank must run the same backward (the same parameters receiving
gradients), and micro-batches of gradient accumulation go inside ``paused()`` except the
last. A backward that reaches a parameter twice without ``paused()`` starts a new pass:
the buckets of the earlier one are waited for and dropped, and all are started again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from amp8.distributed.data_parallel import DataParallelGroup, row_size
from amp8.distributed.fp8_collectives import PendingReduceScatter, fp8_all_gather, start_reduce_scatter_mean

GradientOf = Callable[[nn.Parameter], "torch.Tensor | None"]
HasGradient = Callable[[nn.Parameter], bool]


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    sharded: bool
    ready: set[int] = field(default_factory=set)
    pending: PendingReduceScatter | None = None


class GradientBuckets:
    """Buckets of gradients averaged over the ranks of ``data_parallel``.

    Args:
        data_parallel: the process group and its byte counter.
        params: every parameter, in the optimizer's order.
        gradient: reads a parameter's float32 gradient (None when it has none).
        has_gradient: whether a parameter has a gradient, without reading it.
        is_sharded: True for parameters reduce-scattered (O3's FP8 weights), not all-reduced.
        bucket_elements: elements per bucket before a new one starts.
    """

    def __init__(
        self,
        data_parallel: DataParallelGroup,
        params: list[nn.Parameter],
        gradient: GradientOf,
        has_gradient: HasGradient,
        is_sharded: Callable[[nn.Parameter], bool],
        bucket_elements: int = 1 << 22,
    ) -> None:
        self.data_parallel = data_parallel
        self.params = params
        self.gradient = gradient
        self.has_gradient = has_gradient
        self.buckets: list[_Bucket] = []
        for param in reversed(params):
            sharded = is_sharded(param)
            last = self.buckets[-1] if self.buckets else None
            if last is None or last.sharded != sharded or sum(p.numel() for p in last.params) >= bucket_elements:
                last = _Bucket([], sharded)
                self.buckets.append(last)
            last.params.append(param)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self._next = 0
        self.is_paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside: backward starts no communication (gradient-accumulation micro-batches)."""
        self.is_paused, previous = True, self.is_paused
        try:
            yield
        finally:
            self.is_paused = previous

    @property
    def all_started(self) -> bool:
        """Whether every bucket's all-to-all of this pass has started."""
        return self._next == len(self.buckets)

    @property
    def started(self) -> int:
        """Buckets whose all-to-all is in flight or done in this pass."""
        return sum(bucket.pending is not None for bucket in self.buckets)

    def grad_ready(self, param: nn.Parameter) -> None:
        """Hook target: ``param``'s gradient for this backward is complete (ignored for a
        parameter these buckets do not hold, and inside ``paused()`` or DDP's ``no_sync``)."""
        bucket = self._bucket_of.get(id(param))
        if self.is_paused or not self.data_parallel.backward_sync or bucket is None:
            return
        if id(param) in bucket.ready:  # a second backward without paused(): a new pass
            self.reset()
        bucket.ready.add(id(param))
        while self._next < len(self.buckets):
            candidate = self.buckets[self._next]
            if len(candidate.ready) < len(candidate.params):
                break
            self._start(candidate)
            self._next += 1

    def _flat(self, param: nn.Parameter) -> torch.Tensor:
        grad = self.gradient(param)
        if grad is None:
            grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        return grad.flatten()

    def _start(self, bucket: _Bucket) -> None:
        # A sharded weight's chunks are whole rows: the rows its FSDP2 shard holds.
        rows = tuple(row_size(p.shape) for p in bucket.params) if bucket.sharded else None
        bucket.pending = start_reduce_scatter_mean(
            [self._flat(p) for p in bucket.params], self.data_parallel.group, self.data_parallel.stats, rows
        )

    def reset(self) -> None:
        """Wait for and drop whatever is in flight; forget which gradients were ready."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                for work in bucket.pending.works:
                    work.wait()
            bucket.pending, bucket.ready = None, set()
        self._next = 0

    def finish(self) -> tuple[dict[nn.Parameter, torch.Tensor], dict[nn.Parameter, torch.Tensor]]:
        """Averaged gradients: ``(full means of all-reduced parameters, this rank's chunk of
        the mean of sharded ones)``. Parameters without a gradient on any rank are left out."""
        present = self.data_parallel.present_anywhere([self.has_gradient(p) for p in self.params])
        has_grad = {id(p) for p, flag in zip(self.params, present) if flag}
        for bucket in self.buckets[self._next :]:
            self._start(bucket)
        full: dict[nn.Parameter, torch.Tensor] = {}
        chunks: dict[nn.Parameter, torch.Tensor] = {}
        for bucket in self.buckets:
            pending = bucket.pending
            row = pending.wait()  # type: ignore[union-attr]
            layout = pending.layout  # type: ignore[union-attr]
            if bucket.sharded:
                rank = self.data_parallel.rank
                for index, (param, segment) in enumerate(zip(bucket.params, layout.segments(row))):
                    start, end = layout.shard_range(index, rank)
                    chunks[param] = segment[: end - start]
            else:
                means = fp8_all_gather(row, layout, self.data_parallel.group, self.data_parallel.stats)
                full.update(zip(bucket.params, means))
        self.reset()
        full = {p: v for p, v in full.items() if id(p) in has_grad}
        chunks = {p: v for p, v in chunks.items() if id(p) in has_grad}
        return full, chunks
