"""One parameter's fused Adam update (``amp8.optim.fused``) over amp8's stored tensors:
reads the gradient, moments and weight as they are stored (FP8/FP16 data with scales),
describes their storage as the fused step's ``UpdateSpec``, and writes the results back."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from amp8.config.formats import E4M3
from amp8.optim import fused
from amp8.optim import state as state_storage
from amp8.optim.state import MASTER, MOMENTS
from amp8.tensor.stored import StoredWeight
from amp8.tensor.weight_grad import WeightGrad


def stored_grad(
    param: nn.Parameter, handle: StoredWeight | None
) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """``(data, scales, block size)`` of ``param``'s gradient as stored (FP8 with scales
    for an FP8 layer's weight, else ``param.grad`` without), or None without one."""
    if handle is not None:
        grad = param.grad
        if type(grad) is WeightGrad and not handle.sharded:  # the layer's own FP8 gradient
            return grad.parts()
        scaled = handle.grad()
        return None if scaled is None else (scaled.data, scaled.scale, scaled.block_size)
    return None if param.grad is None else (param.grad, None, 0)


def update_inputs(
    param: nn.Parameter,
    handle: StoredWeight | None,
    param_state: dict[str, Any],
    group: dict[str, Any],
    grad: tuple[torch.Tensor, torch.Tensor | None, int],
) -> tuple[fused.UpdateSpec, fused.Tensors] | None:
    """The ``UpdateSpec`` of ``param``'s update and the stored tensors it reads, given its
    ``stored_grad``; None where a tensor's storage is one the fused step does not cover."""
    grad_data, grad_scale, grad_block_size = grad
    grad_storage = _scale_storage(grad_data, grad_scale, grad_block_size) if handle is not None else fused.Storage()
    moments = [_stored_tensor(param_state, key) for key in MOMENTS]
    if MASTER in param_state:
        kind = fused.WeightKind.MASTER
        weight, weight_scale = _stored_tensor(param_state, MASTER)[:2]
    elif handle is not None:
        kind = fused.WeightKind.FP16_SCALED
        weight, weight_scale = handle.data, handle.scale
    else:
        kind, weight, weight_scale = fused.WeightKind.PLAIN, param.detach(), None
    fp8_storage, fp8_previous = fused.Storage(), False
    if kind is fused.WeightKind.MASTER:
        fp8_storage, fp8_previous = _fp8_weight_storage(handle)  # type: ignore[arg-type]
    if any(storage is None for storage in (grad_storage, moments[0][2], moments[1][2], fp8_storage)):
        return None
    spec = fused.UpdateSpec(
        grad=grad_storage, exp_avg=moments[0][2], exp_avg_sq=moments[1][2],  # type: ignore[arg-type]
        weight=kind, decay=fused.decay_of(group), maximize=bool(group["maximize"]),
        bounded=state_storage.low_bit_moments(param_state),
        fp8_weight=fp8_storage,  # type: ignore[arg-type]
        fp8_margin=handle.recipe.margin if handle is not None else 0,
        fp8_power_of_2=handle.recipe.power_of_2_scales if handle is not None else False,
        fp8_previous_scale=fp8_previous,
    )
    tensors = fused.Tensors(
        grad_data, grad_scale, moments[0][0], moments[0][1], moments[1][0], moments[1][1],
        weight, weight_scale, handle.scale if handle is not None and fp8_previous else None,
    )
    return spec, tensors


def fused_update(
    steps: fused.FusedAdam,
    param: nn.Parameter,
    handle: StoredWeight | None,
    param_state: dict[str, Any],
    group: dict[str, Any],
    next_noise_key: Callable[[], torch.Tensor],
) -> bool:
    """Run ``param``'s update through the fused step: the same operations as the
    reference step, with the noise key ``next_noise_key()`` gives (called once, after
    the storage check). False, with nothing changed, where a tensor's storage is one the
    fused step does not cover (the caller then takes the reference step)."""
    grad = stored_grad(param, handle)
    if grad is None:
        return True
    inputs = update_inputs(param, handle, param_state, group, grad)
    if inputs is None:
        return False
    spec, tensors = inputs
    param_state["step"] += 1
    scalars = fused.coefficients(group, float(param_state["step"]))
    result = steps(spec, tensors, scalars, next_noise_key())
    for key, data, scale in zip(
        MOMENTS, (result.exp_avg, result.exp_avg_sq), (result.exp_avg_scale, result.exp_avg_sq_scale)
    ):
        param_state[key] = data
        if scale is not None:
            param_state[key + state_storage.SCALE_SUFFIX] = scale
    if spec.weight is fused.WeightKind.PLAIN:
        param.copy_(result.weight)
    elif spec.weight is fused.WeightKind.FP16_SCALED:
        handle.store_from_master(result.weight, result.weight_scale)  # type: ignore[union-attr, arg-type]
    else:
        param_state[MASTER], param_state[MASTER + state_storage.SCALE_SUFFIX] = result.weight, result.weight_scale
        handle.store_from_master(result.fp8_weight, result.fp8_weight_scale)  # type: ignore[union-attr, arg-type]
    return True


def _stored_tensor(
    param_state: dict[str, Any], key: str
) -> tuple[torch.Tensor, torch.Tensor | None, fused.Storage | None]:
    """``(data, scales, storage)`` of ``param_state[key]`` as the fused step reads it."""
    data = param_state[key]
    scale = param_state.get(key + state_storage.SCALE_SUFFIX)
    storage = _scale_storage(data, scale, param_state.get(key + state_storage.BLOCK_SUFFIX, 0))
    precision = state_storage.stored_precision(param_state, key)
    if storage is not None and state_storage.rounds_stochastically(key, precision):
        storage = dataclasses.replace(storage, stochastic=True)
    return data, scale, storage


def _scale_storage(data: torch.Tensor, scale: torch.Tensor | None, block_size: int) -> fused.Storage | None:
    """The fused step's ``Storage`` for ``data`` with ``scale``; None for a layout it
    does not cover."""
    if scale is None:
        return fused.Storage() if data.dtype == torch.float32 else None
    if scale.dtype != torch.float32:  # one-byte E8M0 scales: the reference step stores them
        return None
    if scale.dim() == 0:
        return fused.Storage(data.dtype)
    if scale.dim() == 1:
        return fused.Storage(data.dtype, block_size=block_size) if block_size > 0 else None
    if scale.dim() == data.dim() == 2:
        rows, cols = data.shape
        if tuple(scale.shape) == (rows, 1):
            return fused.Storage(data.dtype, rows=True)
        if block_size > 0 and tuple(scale.shape) == (-(-rows // block_size), -(-cols // block_size)):
            return fused.Storage(data.dtype, tile=block_size)
    return None


def _fp8_weight_storage(handle: StoredWeight) -> tuple[fused.Storage | None, bool]:
    """The fused step's ``Storage`` of an FP8 weight and whether its current scales have
    the shape of new ones (``StoredWeight.encode`` then falls back to them). A stack of
    experts' matrices takes the reference step."""
    if handle.param.dim() != 2:
        return None, False
    rows, cols = handle.param.shape
    tile = handle.tile()
    if tile is None:
        storage, shape = fused.Storage(E4M3), ()
    elif tile == (1, cols):
        storage, shape = fused.Storage(E4M3, rows=True), (rows, 1)
    elif tile[0] == tile[1]:
        storage, shape = fused.Storage(E4M3, tile=tile[0]), (-(-rows // tile[0]), -(-cols // tile[0]))
    else:
        return None, False
    if handle.dtype != E4M3:
        return None, False
    return storage, tuple(handle.scale.shape) == shape
