"""``initialize``: wire an opt level into a model and its optimizer."""

from __future__ import annotations

import torch
from torch import nn

from .gemm import check_fp8_device
from .levels import OptLevel, Precision, resolve_level
from .nn.linear import Fp8Linear
from .nn.swap import ModuleFilter, swap_linear_layers
from .optim.adam import LowBitAdam, check_state_precision, check_supported
from .recipe import Recipe


def fp8_layers(model: nn.Module) -> dict[nn.Parameter, Fp8Linear]:
    """``{weight Parameter: layer}`` for every ``Fp8Linear`` in ``model``."""
    return {module.weight: module for module in model.modules() if isinstance(module, Fp8Linear)}


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str | OptLevel = "O1",
    recipe: Recipe | None = None,
    module_filter: ModuleFilter | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Apply an opt level to ``model`` and ``optimizer``; returns ``(model, optimizer)``.

    At O1 and above, every ``nn.Linear`` whose features are multiples of 16, whose weight
    is its own and that ``module_filter(module, fqn)`` accepts (all, by default) becomes
    an ``Fp8Linear`` that reuses its Parameters; the optimizer (``torch.optim.Adam`` or
    ``AdamW``) is replaced by a ``LowBitAdam`` with the same param groups. O0 returns
    both unchanged. Use the returned objects from here on, and build LR schedulers and
    data-parallel wrappers after this call.

    Raises:
        ValueError: unknown opt level (or an override amp8 cannot store), a model amp8
            already initialized, optimizer options amp8 does not support.
        TypeError: a model that is not an ``nn.Module``, an optimizer other than Adam/AdamW.
        RuntimeError: a parameter on a device without FP8 support.
    """
    level = resolve_level(opt_level)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(
            f"model is wrapped in {type(model).__name__}; call amp8.initialize on the bare "
            "model first, then wrap the model it returns"
        )
    if recipe is None:
        recipe = Recipe()
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an amp8.Recipe, got {type(recipe).__name__}")
    if optimizer is not None:
        check_supported(optimizer)
    already = next((name for name, m in model.named_modules() if isinstance(m, Fp8Linear)), None)
    if already is not None:
        raise ValueError(
            f"model is already initialized by amp8 (found Fp8Linear at {already!r}); "
            "call amp8.initialize once, on a model that has not been through it"
        )
    if not level.swaps_layers:
        return model, optimizer
    for device in {param.device for param in model.parameters()}:
        check_fp8_device(device)
    check_state_precision(level)
    # Layers start with FP16 weights, so that O3's FP16 master weights are taken from
    # them before the weights themselves drop to FP8.
    swap_linear_layers(
        model,
        lambda linear: Fp8Linear.from_linear(linear, recipe, Precision.FP16),
        module_filter,
    )
    layers = fp8_layers(model)
    new_optimizer = None
    if optimizer is not None:
        new_optimizer = LowBitAdam.from_optimizer(optimizer, level, layers)
    if level.weight is not Precision.FP16:
        for layer in layers.values():
            layer.set_weight_storage(level.weight)
    return model, new_optimizer
