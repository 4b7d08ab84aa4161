"""The weight of an ``Fp8Linear`` as its GEMMs take it: (N, K), in FP8 with the scales
each GEMM contracts along.

The GEMMs take the (N, K) weight; a ``Conv1D``-like layer's Parameter holds its
transpose, (K, N) (``Fp8Linear.weight_transposed``), and is transposed here, scales
alongside. The FP8 weight is the stored one at O3 where its scales fit the GEMM, else a
cast, which the layer caches until the weight is next written (``Fp8Linear.fp8_weight``).
"""

from __future__ import annotations

import torch

from amp8.config.levels import Precision
from amp8.nn.cast_kernels import decoded
from amp8.nn.quantizer import Quantizer
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


def _cast_stored(quantizer: Quantizer, handle: StoredWeight, transposed: bool, contract_dim: int, *,
                 record: bool, training: bool, watch: tuple[GemmOperand, ...]) -> ScaledTensor:
    """The cast of ``handle``'s weight as the GEMMs take it, decoded from its stored form
    in the cast itself (no float32 copy of the weight in memory where the cast is
    compiled); with ``record``, it records its scale (in ``training``, its amax). For the
    input-gradient GEMM (``contract_dim`` 0), which alone reads this cast, the FP8 data is
    written column-major, as that GEMM takes it, rather than copied so at each backward."""
    stored = handle.stored()
    cast = quantizer.cast_layouts(
        stored.data, contract_dim, record=record, update_history=record and training, watch=watch,
        rows=contract_dim == 1, columns=contract_dim == 0, stored_as=handle.layout, stored_scale=stored.scale,
        transposed=transposed,
    )
    return cast.rows if contract_dim == 1 else cast.columns  # type: ignore[return-value]


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


def cast_weight(
    quantizer: Quantizer, handle: StoredWeight, transposed: bool, cache: dict[int, ScaledTensor], contract_dim: int,
    tile: Tile, *, training: bool, watch: tuple[GemmOperand, ...],
) -> ScaledTensor:
    """The (N, K) FP8 weight of ``handle`` for a GEMM contracting its dim ``contract_dim``
    with scales of ``tile``: the stored FP8 weight at O3 where its scales fit, else a
    cast by ``quantizer`` (from the FP8 weight's real values at O3), which decodes the
    stored weight itself. What is not the stored weight itself is kept in ``cache``, by
    ``contract_dim``, and taken from there (the caller empties it when the weight
    changes), except for a weight amp8 does not store (``AS_IS``), which the user's
    optimizer writes, and O3's casts from the FP8 weight's values. The casts from the
    real weight for the forward GEMM record their scale (and, in ``training``, their
    amax); ``watch``: the operands whose health signals the cast writes."""
    if handle.storage is Precision.AS_IS:
        return _cast_stored(quantizer, handle, transposed, contract_dim, record=contract_dim == 1, training=training,
                            watch=watch)
    if handle.storage is Precision.FP8:
        stored, stored_tile = stored_for_gemms(handle, transposed)
        # Microscaled GEMMs take their own format: re-cast from the stored real values.
        if tile != stored_tile or quantizer.rule.microscaled:
            return _cast_stored(quantizer, handle, transposed, contract_dim, record=False, training=training,
                                watch=watch)
        if not transposed:
            return stored  # the optimizer cast it: nothing to watch here
        # W^T's bytes laid out as (N, K), once until the weight is next written.
        cached = cache.get(contract_dim)
        if cached is None:
            cached = cache[contract_dim] = stored.with_data(stored.data.contiguous())
        return cached
    cached = cache.get(contract_dim)
    if cached is None:
        cached = cache[contract_dim] = _cast_stored(quantizer, handle, transposed, contract_dim,
                                                    record=contract_dim == 1, training=training, watch=watch)
    return cached
