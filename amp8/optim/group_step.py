"""Adam's update of many tensors in one call, over flat buffers.

The tensors of one update group (``amp8.optim.update_groups``: one ``UpdateSpec``, one
step count, one device) are stored one after another in the rows of 2-D buffers, one
buffer per stored tensor kind (gradient, each moment, weight): each tensor takes whole
rows of ``width`` elements, its last row padded with zeros (which stay zero: a zero
gradient moves nothing). A scale is either per tensor, from the max over the tensor's
rows' amaxes, or per buffer row, where the storage keeps one scale per row of a matrix
(``width`` = its columns) or per block of ``width`` elements. Stochastic rounding takes
each element's noise from its tensor's key and its index in that tensor
(``amp8.quant.noise.random_bits_at``), so every value is computed by the same operations,
from the same inputs, as ``amp8.optim.fused.adam_tensor_step`` computes it for the tensor
alone: run eagerly, the result is the reference step's bit for bit.

``adam_group_step`` writes the new moments, weights and scales into its input buffers;
what is fixed between steps is its ``UpdateSpec``, and everything else is a tensor (or a
float eagerly), so one compiled graph serves every step and every group size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amp8.optim.fused import Coefficients, Storage, UpdateSpec, WeightKind, adam_arithmetic
from amp8.optim.state import FIRST_MOMENT_STREAM
from amp8.quant import noise, scaling
from amp8.tensor.stored import FP16_MARGIN

MAX_ELEMENTS = (1 << 31) - 1
"""The most elements a tensor of an update group may hold (int32 element indices)."""


class GroupTensors(NamedTuple):
    """One update group's buffers. Data are (rows, width); a scale is (tensors,) where
    the storage scales per tensor, (rows,) where it scales per row, None where it has
    none."""

    grad: torch.Tensor
    grad_scale: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor | None
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor | None
    weight: torch.Tensor  # FP16 data, FP16 master, or float32 values
    weight_scale: torch.Tensor | None  # per tensor (FP16 storage)
    fp8_weight: torch.Tensor | None  # O3's FP8 weight (WeightKind.MASTER)
    fp8_weight_scale: torch.Tensor | None
    row_tensor: torch.Tensor  # (rows,) int64: the tensor each row belongs to
    row_offset: torch.Tensor  # (rows,) int64: the index in its tensor of the row's first element
    draw: torch.Tensor  # (tensors,) int64: each tensor's draw number, counted from the step's first


def scales_per_row(storage: Storage) -> bool:
    """Whether ``storage`` keeps one scale per buffer row (rows of a matrix, or flat
    blocks) rather than one per tensor."""
    return storage.rows or storage.block_size > 0


def _row_scales(scale: torch.Tensor, per_row: bool, layout: GroupTensors) -> torch.Tensor:
    """``scale`` as one value per buffer row, shaped (rows, 1) to broadcast."""
    return (scale if per_row else scale[layout.row_tensor])[:, None]


def _load(data: torch.Tensor, scale: torch.Tensor | None, storage: Storage, layout: GroupTensors) -> torch.Tensor:
    """float32 values of a stored buffer."""
    if storage.dtype is None or scale is None:
        return data.float()
    return scaling.dequantize(data, _row_scales(scale, scales_per_row(storage), layout))


def _tensor_amax(values: torch.Tensor, layout: GroupTensors) -> torch.Tensor:
    """The absolute maximum of each tensor's values, (tensors,) float32."""
    row_amax = values.abs().amax(dim=1).float()
    tensors = layout.draw.new_zeros(layout.draw.shape, dtype=torch.float32)
    return tensors.scatter_reduce(0, layout.row_tensor, row_amax, "amax")


def _bits(keys: torch.Tensor | int, layout: GroupTensors, width: int) -> torch.Tensor:
    """The noise words of every buffer element under its tensor's key (``keys`` per tensor)."""
    index = layout.row_offset[:, None] + torch.arange(width, device=layout.row_offset.device)
    row_keys = keys[layout.row_tensor][:, None] if isinstance(keys, torch.Tensor) else keys
    return noise.random_bits_at(index, row_keys, MAX_ELEMENTS)


def _quantize(
    values: torch.Tensor, scale: torch.Tensor, per_row: bool, dtype: torch.dtype, layout: GroupTensors,
    keys: torch.Tensor | None,
) -> torch.Tensor:
    """``values`` cast with ``scale``: stochastically under ``keys`` where given."""
    full_scale = _row_scales(scale, per_row, layout)
    if keys is None:
        return scaling.quantize(values, full_scale, dtype)
    return scaling.quantize_with_noise(values, full_scale, dtype, _bits(keys, layout, values.shape[1]))


def _store(
    values: torch.Tensor, storage: Storage, layout: GroupTensors, keys: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(data, scales)`` storing float32 ``values`` as ``amp8.optim.state.store`` would
    store each tensor: scales from the amax of each row or tensor."""
    if storage.dtype is None:
        return values, None
    per_row = scales_per_row(storage)
    amax = values.abs().amax(dim=1).float() if per_row else _tensor_amax(values, layout)
    scale = scaling.scale_from_amax(amax, storage.dtype)
    moment_keys = noise.stream_key(keys, FIRST_MOMENT_STREAM) if storage.stochastic and keys is not None else None
    return _quantize(values, scale, per_row, storage.dtype, layout, moment_keys), scale


def _encode_fp16(
    values: torch.Tensor, previous: torch.Tensor, layout: GroupTensors, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``amp8.tensor.stored.encode_fp16`` of each tensor: one power-of-two scale with a
    binade of headroom (the old one where a tensor is all zeros), stochastic rounding."""
    scale = scaling.scale_from_amax(
        _tensor_amax(values, layout), torch.float16, margin=FP16_MARGIN, power_of_2=True, previous=previous
    )
    return _quantize(values, scale, False, torch.float16, layout, keys), scale


def _encode_fp8(
    values: torch.Tensor, previous: torch.Tensor | None, spec: UpdateSpec, layout: GroupTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """O3's FP8 weight from its new master values (``StoredWeight.encode``)."""
    storage = spec.fp8_weight
    assert storage.dtype is not None  # UpdateSpec construction guarantees it
    per_row = scales_per_row(storage)
    amax = values.abs().amax(dim=1).float() if per_row else _tensor_amax(values, layout)
    scale = scaling.scale_from_amax(
        amax, storage.dtype, margin=spec.fp8_margin, power_of_2=spec.fp8_power_of_2, previous=previous
    )
    return _quantize(values, scale, per_row, storage.dtype, layout, None), scale


def adam_group_step(
    spec: UpdateSpec, tensors: GroupTensors, scalars: Coefficients, seed_part: torch.Tensor | int,
    first_draw: torch.Tensor | int,
) -> None:
    """One Adam / AdamW update of every tensor in ``tensors``, written into its buffers.

    Tensor ``t`` rounds under the noise key ``noise.rounding_key(seed, first_draw + draw[t])``
    (from ``seed_part = noise.seed_key(seed)``), the key the reference step draws for it.
    """
    grad = _load(tensors.grad, tensors.grad_scale, spec.grad, tensors)
    exp_avg = _load(tensors.exp_avg, tensors.exp_avg_scale, spec.exp_avg, tensors)
    exp_avg_sq = _load(tensors.exp_avg_sq, tensors.exp_avg_sq_scale, spec.exp_avg_sq, tensors)
    if spec.weight is WeightKind.PLAIN:
        weight = tensors.weight.float()
    else:
        weight = scaling.dequantize(tensors.weight, _row_scales(tensors.weight_scale, False, tensors))
    exp_avg, exp_avg_sq, weight = adam_arithmetic(
        grad, exp_avg, exp_avg_sq, weight, scalars, decay=spec.decay, maximize=spec.maximize, bounded=spec.bounded
    )
    stochastic = spec.weight is not WeightKind.PLAIN or spec.exp_avg.stochastic
    keys = noise.draw_key(seed_part, tensors.draw + first_draw) if stochastic else None
    for (values, storage), data, scale in zip(
        ((exp_avg, spec.exp_avg), (exp_avg_sq, spec.exp_avg_sq)),
        (tensors.exp_avg, tensors.exp_avg_sq), (tensors.exp_avg_scale, tensors.exp_avg_sq_scale),
    ):
        new_data, new_scale = _store(values, storage, tensors, keys)
        data.copy_(new_data)
        if scale is not None and new_scale is not None:
            scale.copy_(new_scale)
    if spec.weight is WeightKind.PLAIN:
        tensors.weight.copy_(weight)
        return
    assert keys is not None and tensors.weight_scale is not None
    new_weight, new_scale = _encode_fp16(weight, tensors.weight_scale, tensors, keys)
    tensors.weight.copy_(new_weight)
    if spec.weight is WeightKind.MASTER:
        assert tensors.fp8_weight is not None and tensors.fp8_weight_scale is not None
        previous = tensors.fp8_weight_scale if spec.fp8_previous_scale else None
        fp8_weight, fp8_scale = _encode_fp8(weight, previous, spec, tensors)
        tensors.fp8_weight.copy_(fp8_weight)
        tensors.fp8_weight_scale.copy_(fp8_scale)
    tensors.weight_scale.copy_(new_scale)
