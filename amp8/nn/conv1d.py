"""Taking the place of a ``Conv1D``-like module and giving it back.

A ``Conv1D``-like module (GPT-2's ``transformers.pytorch_utils.Conv1D``; see
``amp8.nn.gemm_layers``) computes ``y = x W + b`` with its weight stored (in, out).
``Fp8Linear.from_conv1d`` takes over its Parameters and keeps a copy of the module
without them; ``Fp8Linear.replaced_module`` gives that module back, holding real weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def conv1d_parameters(conv1d: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The ``weight`` and ``bias`` Parameters of the ``Conv1D``-like ``conv1d``.

    Raises:
        TypeError: ``conv1d`` has no 2-D ``weight`` Parameter with a bias of its second
            dim (or none).
    """
    weight, bias = getattr(conv1d, "weight", None), getattr(conv1d, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or (
        bias is not None and tuple(bias.shape) != (weight.shape[1],)
    ):
        raise TypeError(
            f"Fp8Linear.from_conv1d takes a Conv1D-like module (a 2-D weight Parameter of shape "
            f"(in, out) and a bias of shape (out,) or None), got {type(conv1d).__name__}; use "
            "Fp8Linear.from_linear for an nn.Linear"
        )
    return weight, bias


def without_parameters(module: nn.Module) -> nn.Module:
    """A copy of ``module`` without its own Parameters (None in their places), to keep
    outside the module tree: not in ``state_dict``, and holding no weight that sharding
    replaces."""
    return copy.deepcopy(module, {id(p): None for p in module.parameters(recurse=False)})


def with_parameters(
    template: nn.Module, real_weight: torch.Tensor, weight_requires_grad: bool, bias: torch.Tensor | None,
    training: bool,
) -> nn.Module:
    """A new copy of ``template`` (from ``without_parameters``) holding copies of
    ``real_weight`` and ``bias`` as its Parameters (the weight's ``requires_grad`` as
    given, the bias's as it has it), in training mode where ``training``."""
    plain = copy.deepcopy(template)
    plain.weight = nn.Parameter(real_weight.detach().clone(), requires_grad=weight_requires_grad)
    if bias is not None:
        plain.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    plain.train(training)
    return plain
