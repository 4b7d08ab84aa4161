"""The weight of an ``Fp8Linear`` as its GEMMs take it: (N, K), in FP8 with the scales
each GEMM contracts along.

The GEMMs take the (N, K) weight; a ``Conv1D``-like layer's Parameter holds its
transpose, (K, N) (``Fp8Linear.weight_transposed``), and is transposed here, scales
alongside. The FP8 weight is the stored one at O3 where its scales fit the GEMM, else a
cast, which the layer caches until the weight is next written (``Fp8Linear.fp8_weight``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from amp8.config.levels import Precision
from amp8.nn.cast_kernels import decoded
from amp8.nn.quantizer import CastRequest, Quantizer, cast_operands
from amp8.quant.health import GemmOperand
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import StoredWeight

Tile = tuple[int, int] | None
"""The tile sharing one scale; None for one scale per tensor."""


def gemm_weight_shape(weight: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """The (N, K) shape of ``weight`` as the GEMMs take it (``transposed``: it holds
    ``W^T``)."""
    rows, columns = weight.shape
    return (columns, rows) if transposed else (rows, columns)


def real_for_gemms(handle: StoredWeight, transposed: bool) -> torch.Tensor:
    """The real values of ``handle``'s weight in float32 as the GEMMs take them, (N, K):
    the transpose of ``handle.read()`` where the Parameter holds ``W^T``."""
    stored = handle.stored()
    return decoded(handle.layout, transposed, stored.data, stored.scale)


def _stored_cast(quantizer: Quantizer, handle: StoredWeight, transposed: bool, use: "WeightUse", *,
                 record: bool, training: bool, replay: bool) -> CastRequest:
    """The cast of ``handle``'s weight as the GEMMs take it, for ``use``, decoded from its
    stored form in the cast itself (no float32 copy of the weight in memory where the
    cast is compiled); with ``record``, it records its scale (in ``training``, its amax).
    For the input-gradient GEMM (``contract_dim`` 0), which alone reads this cast, the
    FP8 data is written column-major, as that GEMM takes it, rather than copied so at
    each backward. With ``replay`` it repeats a cast made before and records nothing
    (``CastSpec.replay``)."""
    stored = handle.stored()
    return quantizer.request(
        stored.data, stored.scale, contract_dim=use.contract_dim, record=record, update_history=record and training,
        watch=use.watch, rows=use.contract_dim == 1, columns=use.contract_dim == 0, stored_as=handle.layout,
        transposed=transposed, replay=replay,
    )


def stored_for_gemms(handle: StoredWeight, transposed: bool) -> tuple[ScaledTensor, Tile]:
    """``handle``'s stored weight as the GEMMs take it, (N, K), and the tile of its
    scales for the forward GEMM: where the Parameter holds ``W^T``, its transpose with
    the scales transposed alongside (exact: the same values and scales)."""
    stored, tile = handle.stored(), handle.tile()
    if not transposed:
        return stored, tile
    return stored.t(), None if tile is None else (tile[1], tile[0])


def weight_operands(contract_dim: int, one_tile: bool) -> tuple[GemmOperand, ...]:
    """The GEMM operands a cast of the weight for ``contract_dim`` serves (``one_tile``:
    the forward and input-gradient GEMMs take the weight with the same scale tiles)."""
    if contract_dim == 0:
        return (GemmOperand.DGRAD_WEIGHT,)
    if one_tile:
        return (GemmOperand.FPROP_WEIGHT, GemmOperand.DGRAD_WEIGHT)
    return (GemmOperand.FPROP_WEIGHT,)


class WeightUse(NamedTuple):
    """A GEMM's use of the weight: the dim of (N, K) it contracts, the tile of the
    scales it takes (None for one per tensor), and the operands whose health signals
    its cast writes."""

    contract_dim: int
    tile: Tile
    watch: tuple[GemmOperand, ...] = ()


def cast_weights(
    quantizer: Quantizer, handle: StoredWeight, transposed: bool, cache: dict[int, ScaledTensor],
    uses: tuple[WeightUse, ...], *, training: bool, replay: bool = False,
) -> tuple[ScaledTensor, ...]:
    """The (N, K) FP8 weight of ``handle`` for each of ``uses``: the stored FP8 weight at
    O3 where its scales fit, else a cast by ``quantizer`` (from the FP8 weight's real
    values at O3), which decodes the stored weight itself; the casts run together (one
    call of compiled kernels, ``amp8.nn.quantizer.cast_operands``). What is not the stored
    weight itself is kept in ``cache``, by ``contract_dim``, and taken from there (the
    caller empties it when the weight changes), except for a weight amp8 does not store
    (``AS_IS``), which the user's optimizer writes, and O3's casts from the FP8 weight's
    values. The casts from the real weight for the forward GEMM record their scale (and,
    in ``training``, their amax), unless they ``replay`` a forward's (``CastSpec.replay``)."""
    ready: dict[int, ScaledTensor] = {}
    requests: list[CastRequest] = []

    def cast(use: WeightUse, record: bool) -> CastRequest:
        return _stored_cast(quantizer, handle, transposed, use, record=record, training=training, replay=replay)

    for use in uses:
        dim = use.contract_dim
        if handle.storage is Precision.AS_IS:
            requests.append(cast(use, dim == 1))
        elif handle.storage is Precision.FP8:
            stored, stored_tile = stored_for_gemms(handle, transposed)
            if use.tile != stored_tile or quantizer.rule.microscaled:
                # Microscaled GEMMs take their own format: re-cast from the stored real values.
                requests.append(cast(use, False))
            elif not transposed:
                ready[dim] = stored  # the optimizer cast it: nothing to watch here
            else:  # W^T's bytes laid out as (N, K), once until the weight is next written
                if dim not in cache:
                    cache[dim] = stored.with_data(stored.data.contiguous())
                ready[dim] = cache[dim]
        elif dim in cache:
            ready[dim] = cache[dim]
        else:
            requests.append(cast(use, dim == 1))
    for request, made in zip(requests, cast_operands(tuple(requests))):
        dim = request.spec.contract_dim
        ready[dim] = made.rows if dim == 1 else made.columns  # type: ignore[assignment]
        if handle.storage not in (Precision.AS_IS, Precision.FP8):
            cache[dim] = ready[dim]
    return tuple(ready[use.contract_dim] for use in uses)
