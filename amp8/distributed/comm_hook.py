"""``fp8_compress_hook``: a DDP comm hook that averages gradient buckets with FP8 on the
wire, asynchronously.

Each bucket is averaged as ``fp8_collectives`` averages any tensor: cut into one chunk per
rank, each chunk cast to E4M3 with its own scale, an all-to-all to the chunk's owner, a
float32 sum there, a cast back to E4M3 and an all-gather. The hook starts the all-to-all
and returns a future at once, so DDP goes on with backward (and with its next buckets)
while the bucket is on the wire; the future completes when the all-gather has arrived and
is decoded, as ``torch``'s ``fp16_compress_hook`` chains its decode on the all-reduce's
future.

Where the all-gather starts. Every rank must issue the collectives of one process group
in the same order. gloo completes a collective on one of its worker threads and runs the
future's ``.then()`` callbacks there, so an all-gather started from such a callback would
race with the collectives the backward thread starts meanwhile (DDP's next buckets, amp8's
FP8 weight buckets) and could come in a different order on each rank. So the hook starts
the all-gather of a bucket on the backward thread, at its next call, right after starting
that call's all-to-all; the last bucket of a backward (``bucket.is_last()``) starts its own
at once. Only decoding the gathered bytes runs in a callback. Every collective thus starts
in DDP's bucket order on every rank, each bucket's all-to-all overlaps the backward
computation until the next bucket is ready, and the values are those of
``fp8_all_reduce_mean``, bit for bit, on every rank.

The bucket in flight between two calls lives in the hook's state, a ``DataParallelGroup``
(``comm_hook_in_flight``): no global state. With a process group (or None) as the state,
there is nowhere to keep it, so each call starts its bucket's all-gather itself, after
waiting for its all-to-all; the returned future still completes only with the all-gather.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from amp8.distributed.data_parallel import DataParallelGroup
from amp8.distributed.fp8_collectives import (
    PendingAllGather, PendingReduceScatter, WireStats, start_all_gather, start_reduce_scatter_mean,
)


@dataclass
class BucketInFlight:
    """One DDP bucket being averaged: its all-to-all in flight, and the future the hook
    returned for it, completed with the mean in the bucket's dtype and shape."""

    reduce_scatter: PendingReduceScatter
    result: torch.futures.Future
    dtype: torch.dtype
    shape: torch.Size


def fp8_compress_hook(
    state: DataParallelGroup | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that averages each gradient bucket with FP8 on the wire.

    Register it with ``ddp.register_comm_hook(state, amp8.distributed.fp8_compress_hook)``,
    as torch's ``fp16_compress_hook``; ``amp8.distributed.register_ddp`` does that for an
    amp8 model. ``state`` is an ``amp8.distributed.DataParallelGroup`` (its byte counter
    then counts what this rank sends, and it keeps a bucket in flight until the next
    one is ready, see the module docstring), or the process group to average over (None:
    the default group). The bucket is cut into one chunk per rank, each chunk cast to E4M3
    with its own scale, summed in FP32 by its owner and cast back (an all-to-all and an
    all-gather): one byte per element per rank, a quarter of FP32's all-reduce. The hook
    returns before the bucket's communication completes (the last bucket of a backward:
    with its all-gather started); the future's result, in the bucket's dtype, is identical
    on every rank.
    """
    if isinstance(state, DataParallelGroup):
        group, stats, in_flight = state.group, state.stats, state.comm_hook_in_flight
    else:
        group, stats, in_flight = state, None, None
    started = _start(bucket.buffer(), group, stats)
    if in_flight is None:  # nowhere to keep it: finish this bucket's collectives now
        _finish(started, group, stats)
        return started.result
    earlier = list(in_flight)
    in_flight.clear()
    for waiting in earlier:
        _finish(waiting, group, stats)
    if bucket.is_last():
        _finish(started, group, stats)
    else:
        in_flight.append(started)
    return started.result


def _result_future(device: torch.device) -> torch.futures.Future:
    """An empty future for a bucket on ``device`` (aware of CUDA streams on CUDA)."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def _start(buffer: torch.Tensor, group: dist.ProcessGroup | None, stats: WireStats | None) -> BucketInFlight:
    """Cast ``buffer`` to per-chunk-scaled E4M3 and start its all-to-all."""
    pending = start_reduce_scatter_mean([buffer.flatten().float()], group, stats)
    return BucketInFlight(pending, _result_future(buffer.device), buffer.dtype, buffer.shape)


def _finish(started: BucketInFlight, group: dist.ProcessGroup | None, stats: WireStats | None) -> None:
    """Wait for the bucket's all-to-all, sum, re-cast and start its all-gather; the
    bucket's future completes when the all-gather has arrived and is decoded."""
    try:
        row = started.reduce_scatter.wait()
        gather = start_all_gather(row, started.reduce_scatter.layout, group, stats)
    except Exception as error:
        started.result.set_exception(error)
        raise
    gather.future().then(lambda done: _complete(started, gather, done))


def _complete(started: BucketInFlight, gather: PendingAllGather, done: torch.futures.Future) -> None:
    """``.then()`` callback (on the backend's thread under gloo): decode the gathered
    bytes into the bucket's future, or pass on the collective's error. Starts no
    collective (see the module docstring)."""
    try:
        for collective in done.wait():
            collective.wait()  # raises the collective's error, if any
        (mean,) = gather.result()
        started.result.set_result(mean.to(started.dtype).view(started.shape))
    except Exception as error:  # the future must complete, or DDP waits for it forever
        started.result.set_exception(error)
