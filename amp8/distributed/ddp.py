"""amp8 under the user's ``DistributedDataParallel``: the FP8 comm hook, and what DDP
must leave to amp8.

apex's order works: ``model, optimizer = amp8.initialize(...)`` in every process, then
``model = DistributedDataParallel(model)``. ``initialize`` lists the FP8 layers' weights
and buffers in the model's ``_ddp_params_and_buffers_to_ignore`` (DDP's stock opt-out),
because their gradients are FP8 tensors DDP's buckets cannot hold and gloo cannot send
FP8 buffers. DDP then does what it does for every other parameter (broadcast at wrap,
buckets, ``no_sync``, ``find_unused_parameters``, ``static_graph``), and amp8's gradient
reduction averages the FP8 weight gradients over DDP's process group, FP8 on the wire.

amp8 sees the DDP around the model at its first forward (a forward pre-hook reads
``DistributedDataParallel._get_active_ddp_module()``, what TorchDynamo reads too) and
registers ``fp8_compress_hook`` on it, unless the user registered a hook of their own: so
biases, norms and embeddings travel in FP8 as well. ``fp8_compress_hook`` is public: it
serves any DDP model, amp8 layers or not.

Under ``find_unused_parameters=True`` a rank may leave FP8 weights without a gradient
(LayerDrop, MoE routing) that another rank gives one: amp8 then averages the FP8
weights' gradients when each backward ends (a zero gradient for the unused ones), on
every rank alike, after DDP has started its own reductions.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from amp8.distributed.data_parallel import DataParallelGroup
from amp8.distributed.fp8_collectives import fp8_all_reduce_mean
from amp8.nn.hooks import remove_forward_hooks
from amp8.tensor.stored import stored_weight


def fp8_compress_hook(
    state: DataParallelGroup | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that averages each gradient bucket with FP8 on the wire.

    Register it with ``ddp.register_comm_hook(state, amp8.distributed.fp8_compress_hook)``, as
    torch's ``fp16_compress_hook``. ``state`` is the process group to average over (None:
    the default group) or an ``amp8.distributed.DataParallelGroup``, whose byte counter then counts
    what this rank sends. The bucket is cut into one chunk per rank, each chunk cast to
    E4M3 with its own scale, summed in FP32 by its owner and cast back (an all-to-all and
    an all-gather): one byte per element per rank, a quarter of FP32's all-reduce. The
    result, in the bucket's dtype, is identical on every rank.
    """
    if isinstance(state, DataParallelGroup):
        group, stats = state.group, state.stats
    else:
        group, stats = state, None
    buffer = bucket.buffer()
    (mean,) = fp8_all_reduce_mean([buffer.float()], group, stats)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(mean.to(buffer.dtype).view_as(buffer))
    return future


def amp8_names(model: nn.Module) -> list[str]:
    """The names of the FP8 layers' weights and buffers in ``model``: what DDP must leave
    to amp8."""
    names = []
    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and stored_weight(weight) is not None:
            dotted = prefix + "." if prefix else ""
            names.append(dotted + "weight")
            names.extend(dotted + name for name, _ in module.named_buffers(recurse=False))
    return names


def leave_to_amp8(model: nn.Module) -> None:
    """Tell a ``DistributedDataParallel`` built later around ``model`` to leave amp8's
    weights and buffers alone (``_ddp_params_and_buffers_to_ignore``, kept with any names
    the user listed)."""
    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    names += [name for name in amp8_names(model) if name not in names]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


class DdpWatch:
    """The forward hooks by which amp8 finds the DDP running ``model``: the first time,
    amp8 hands it the model's other parameters and registers ``fp8_compress_hook``; every
    time, it reads whether this backward synchronizes (``no_sync``) and, under
    ``find_unused_parameters=True``, has the FP8 weights' gradients averaged when the
    backward ends. A model whose FP8 weights FSDP2 shards (``sharded``, O3) refuses DDP."""

    def __init__(self, data_parallel: DataParallelGroup, sharded: bool) -> None:
        self.data_parallel = data_parallel
        self.sharded = sharded

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: find the DDP around ``module`` (see the class docstring)."""
        ddp = nn.parallel.DistributedDataParallel._get_active_ddp_module()
        if ddp is None or ddp.module is not module:
            return
        if self.sharded:
            raise RuntimeError(
                "DistributedDataParallel wraps a model whose FP8 weights amp8 sharded with "
                "FSDP2 (opt level O3 in a process group): amp8 averages every gradient itself "
                "there; use the model without DDP, or O1/O2 under DDP"
            )
        if self.data_parallel.ddp is not ddp:
            _adopt(ddp, self.data_parallel)
        self.data_parallel.backward_sync = bool(ddp.require_backward_grad_sync)

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: where gradients are averaged when backward ends, have the first
        output gradient of this forward's backward queue that (on every rank)."""
        data_parallel = self.data_parallel
        if not (data_parallel.reduces_at_backward_end and data_parallel.backward_sync and torch.is_grad_enabled()):
            return
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, self._backward_started, mode="any")

    def _backward_started(self, grad: torch.Tensor) -> None:
        for callback in self.data_parallel.at_backward_end:
            torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def watch_for_ddp(model: nn.Module, data_parallel: DataParallelGroup, *, sharded: bool = False) -> DdpWatch:
    """Register ``DdpWatch``'s hooks on ``model``; returns the watch."""
    watch = DdpWatch(data_parallel, sharded)
    model.register_forward_pre_hook(watch.before_forward)
    model.register_forward_hook(watch.after_forward)
    return watch


def stop_watching(model: nn.Module, names: list[str]) -> None:
    """Remove amp8's DDP hooks from ``model``, and ``names`` (``amp8_names`` of the amp8
    model it copies: see ``amp8.export``) from what DDP ignores: a DDP built around it
    later treats it as any model."""
    remove_forward_hooks(model, lambda owner: isinstance(owner, DdpWatch))
    ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    if ignored is not None:
        removed = set(names)
        kept = [name for name in ignored if name not in removed]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, kept)


def _adopt(ddp: nn.parallel.DistributedDataParallel, data_parallel: DataParallelGroup) -> None:
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    missing = [name for name in amp8_names(ddp.module) if name not in ignored]
    if missing:
        raise RuntimeError(
            f"DistributedDataParallel wraps an amp8 model but does not leave {missing[0]!r} "
            "to amp8; call amp8.initialize in every process before wrapping the model in DDP, "
            "and do not replace the model's _ddp_params_and_buffers_to_ignore"
        )
    data_parallel.group = ddp.process_group
    data_parallel.ddp = ddp
    try:
        ddp.register_comm_hook(data_parallel, fp8_compress_hook)
    except RuntimeError:  # the user registered a hook of their own: it stays
        pass
