"""Gradient-norm clipping over FP8 weight gradients and ordinary gradients alike."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..nn.linear import Fp8Linear
from .adam import LowBitAdam


def _fp8_layers(source: nn.Module | LowBitAdam) -> list[Fp8Linear]:
    if isinstance(source, LowBitAdam):
        return list(source.fp8_layers.values())
    return [module for module in source.modules() if isinstance(module, Fp8Linear)]


def _ordinary_params(source: nn.Module | LowBitAdam, layers: list[Fp8Linear]) -> list[nn.Parameter]:
    fp8_weights = {id(layer.weight) for layer in layers}
    if isinstance(source, LowBitAdam):
        params = [p for group in source.param_groups for p in group["params"]]
    else:
        params = list(source.parameters())
    return [p for p in params if id(p) not in fp8_weights and p.grad is not None]


def clip_grad_norm_(
    model_or_optimizer: nn.Module | LowBitAdam, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale all gradients so their total norm is at most ``max_norm``; returns the norm.

    The norm covers the FP8 weight gradients of ``Fp8Linear`` layers (which are not in
    ``param.grad``) and every ordinary gradient. FP8 gradients are scaled exactly, by
    changing their scale. A non-finite norm scales nothing: the optimizer skips that step.

    Args:
        model_or_optimizer: the model, or the optimizer ``amp8.initialize`` returned.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm (``inf`` for the max norm).

    Raises:
        TypeError: for an iterable of parameters, which cannot reach FP8 gradients.
    """
    if not isinstance(model_or_optimizer, (nn.Module, LowBitAdam)):
        raise TypeError(
            "amp8.clip_grad_norm_ takes the model or the optimizer amp8.initialize returned, "
            f"not {type(model_or_optimizer).__name__}: FP8 weight gradients live on the "
            "layers, not in param.grad"
        )
    layers = [layer for layer in _fp8_layers(model_or_optimizer) if layer.weight_grad is not None]
    params = _ordinary_params(model_or_optimizer, layers)
    norms = [torch.linalg.vector_norm(layer.weight_grad.dequantize(), norm_type) for layer in layers]
    norms += [torch.linalg.vector_norm(p.grad.float(), norm_type) for p in params]
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]), norm_type)
    if not torch.isfinite(total) or total <= max_norm:
        return total
    coefficient = max_norm / (float(total) + 1e-6)
    for layer in layers:
        grad = layer.weight_grad
        layer.weight_grad = dataclasses.replace(grad, scale=grad.scale / coefficient)
    for param in params:
        param.grad.mul_(coefficient)
    return total
