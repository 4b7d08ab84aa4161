"""Hugging Face Accelerate with amp8: average the FP8 gradients before clipping.

In a process group, ``accelerator.prepare`` wraps the model in
``DistributedDataParallel``, which averages every gradient but the FP8 layers' weights'
during backward; amp8 averages those at ``optimizer.step()`` (see ``amp8.comm.ddp``).
``accelerator.clip_grad_norm_`` runs between the two, so without this call each rank
would measure its own FP8 gradients, clip by its own factor and the ranks' biases and
norms would drift apart. Call ``synchronize_gradients`` first::

    with accelerator.accumulate(model):
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            amp8.integrations.accelerate.synchronize_gradients(optimizer)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

In one process it does nothing, so the same loop serves both.
"""

from __future__ import annotations

from typing import Any

from ..optim.adam import LowBitAdam

_MAX_WRAPPERS = 8


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside the wrappers trainers put around it (``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``: each keeps it as ``.optimizer``), or ``optimizer``
    itself when it is not wrapped."""
    inner = optimizer
    for _ in range(_MAX_WRAPPERS):
        if isinstance(inner, LowBitAdam):
            return inner
        wrapped = getattr(inner, "optimizer", None)
        if wrapped is None:
            return inner
        inner = wrapped
    raise TypeError(f"{type(optimizer).__name__} wraps more than {_MAX_WRAPPERS} optimizers; pass the inner one")


def synchronize_gradients(optimizer: Any) -> None:
    """Average the gradients of the amp8 optimizer inside ``optimizer`` over its ranks now
    (``LowBitAdam.synchronize``), so clipping sees the averaged FP8 weight gradients;
    ``step()`` then reduces nothing twice. Outside a process group, and for any optimizer
    that is not amp8's, it does nothing.

    Call it where gradients are final: after the backward of the last micro-batch of an
    accumulation round (``accelerator.sync_gradients`` is True), before clipping.
    """
    inner = unwrap_optimizer(optimizer)
    if isinstance(inner, LowBitAdam):
        inner.synchronize()
