"""Gradient-norm clipping over FP8 weight gradients and ordinary gradients alike.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works on amp8 models too:
an FP8 weight gradient sits in ``weight.grad`` as a ``WeightGrad``, which norms read in
float32 and which a multiplication rescales exactly. ``amp8.clip_grad_norm_`` gives the
same result and also reaches the gradients that O3 keeps for FSDP2-sharded weights.
"""

from __future__ import annotations

import torch
from torch import nn

from amp8.optim.adam import LowBitAdam
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import stored_weight


def _parameters(source: nn.Module | LowBitAdam) -> list[nn.Parameter]:
    if isinstance(source, LowBitAdam):
        return [p for group in source.param_groups for p in group["params"]]
    return list(source.parameters())


def clip_grad_norm_(
    model_or_optimizer: nn.Module | LowBitAdam, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale all gradients so their total norm is at most ``max_norm``; returns the norm.

    The norm covers the FP8 weight gradients of ``Fp8Linear`` layers and every ordinary
    gradient. FP8 gradients are scaled exactly, by changing their scale. A non-finite
    norm scales nothing: the optimizer skips that step.

    Args:
        model_or_optimizer: the model, or the optimizer ``amp8.initialize`` returned.
        max_norm: the largest allowed total norm (>= 0).
        norm_type: the p of the p-norm (``inf`` for the max norm; > 0).

    Raises:
        TypeError: for an iterable of parameters (use ``torch.nn.utils.clip_grad_norm_``).
        ValueError: a negative ``max_norm`` or a ``norm_type`` that is not > 0.
    """
    if not isinstance(model_or_optimizer, (nn.Module, LowBitAdam)):
        raise TypeError(
            "amp8.clip_grad_norm_ takes the model or the optimizer amp8.initialize returned, "
            f"not {type(model_or_optimizer).__name__}; for parameters, "
            "torch.nn.utils.clip_grad_norm_ handles FP8 weight gradients too"
        )
    if not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm!r} is not valid; use max_norm >= 0")
    if not norm_type > 0:
        raise ValueError(f"norm_type={norm_type!r} is not valid; use a p > 0 or inf")
    fp8: list[ScaledTensor] = []
    plain: list[torch.Tensor] = []
    for param in _parameters(model_or_optimizer):
        handle = stored_weight(param)
        grad = handle.grad() if handle is not None else param.grad
        if isinstance(grad, ScaledTensor):
            fp8.append(grad)
        elif grad is not None:
            plain.append(grad)
    norms = [torch.linalg.vector_norm(grad.dequantize(), norm_type) for grad in fp8]
    norms += [torch.linalg.vector_norm(grad.float(), norm_type) for grad in plain]
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]), norm_type)
    if not torch.isfinite(total) or total <= max_norm:
        return total
    coefficient = max_norm / (float(total) + 1e-6)
    for grad in fp8:
        grad.scale.div_(coefficient)
    for grad in plain:
        grad.mul_(coefficient)
    return total
