"""The hooks ``register_ddp`` puts on the user's DDP, to follow its ``no_sync`` and, where
gradients are averaged when backward ends, to queue that averaging."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from amp8.distributed.data_parallel import DataParallelGroup


class DdpWatch:
    """The hooks ``register_ddp`` puts on the user's DDP: before each forward, whether
    this backward synchronizes (``no_sync``); after it, under
    ``find_unused_parameters=True``, the FP8 weights' gradients averaged when the backward
    ends. They do nothing for a DDP that is no longer the registered one."""

    def __init__(self, data_parallel: DataParallelGroup) -> None:
        self.data_parallel = data_parallel

    def before_forward(self, ddp: nn.Module, args: Any) -> None:
        """Forward pre-hook on the DDP: read whether the coming backward synchronizes."""
        if self.data_parallel.ddp is ddp:
            self.data_parallel.backward_sync = bool(ddp.require_backward_grad_sync)

    def after_forward(self, ddp: nn.Module, args: Any, output: Any) -> None:
        """Forward hook on the DDP: where gradients are averaged when backward ends, have
        the first output gradient of this forward's backward queue that (on every rank)."""
        data_parallel = self.data_parallel
        if data_parallel.ddp is not ddp or not torch.is_grad_enabled():
            return
        if not (data_parallel.reduces_at_backward_end and data_parallel.backward_sync):
            return
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, self._backward_started, mode="any")

    def _backward_started(self, grad: torch.Tensor) -> None:
        # torch has no public way to run code when a backward ends; its DDP comm hooks and
        # FSDP queue their callbacks with the engine the same way.
        for callback in self.data_parallel.at_backward_end:
            torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or tensors in (nested) tuples, lists
    and mappings (a Hugging Face ``ModelOutput`` is one)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [tensor for item in output for tensor in tensors_in(item)]
    return []
