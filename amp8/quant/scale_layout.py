"""Memory layouts cuBLAS reads: row- and column-major GEMM operands, and the swizzled
layout of block scales that Blackwell's block-scaled GEMMs read.

cuBLAS (its "1D block scaling factors layout") and CUTLASS take the scales of a
(rows, K / block) matrix of block scales in 128 x 4 tiles: the matrix is zero-padded to
multiples of (128, 4), the tiles are stored one after another (row of tiles by row of
tiles), and inside a tile row ``r`` and column ``c`` go to position ``(r % 32, 4 * (r //
32) + c)`` of a 32 x 16 block, i.e. the four 32-row groups of the tile are interleaved.

``swizzle`` builds that layout as a (32 * row_tiles, 16 * column_tiles) tensor, the
shape ``amp8.ops.gemm`` checks; ``unswizzle`` inverts it. Both only move bytes, so they work
for E8M0 and E4M3 scales alike.
"""

from __future__ import annotations

import torch

GEMM_ALIGNMENT = 16
"""K and N of an FP8 GEMM are multiples of this: 16 bytes of one-byte elements."""
TILE_ROWS, TILE_COLUMNS = 128, 4
_GROUPS = TILE_ROWS // 32  # 32-row groups per tile, interleaved along the 16 columns


def is_row_major(x: torch.Tensor) -> bool:
    """Whether the 2-D ``x`` is row-major (rows contiguous, one after another)."""
    # An empty tensor has no layout to get wrong (``contiguous()`` leaves its strides).
    return x.numel() == 0 or (x.stride(1) == 1 and x.stride(0) >= max(1, x.shape[1]))


def is_column_major(x: torch.Tensor) -> bool:
    """Whether the 2-D ``x`` is column-major (columns contiguous, one after another)."""
    return x.numel() == 0 or (x.stride(0) == 1 and x.stride(1) >= max(1, x.shape[0]))


def swizzled_shape(rows: int, columns: int) -> tuple[int, int]:
    """The shape of ``swizzle`` applied to a (rows, columns) matrix of scales."""
    return 32 * -(-rows // TILE_ROWS), 16 * -(-columns // TILE_COLUMNS)


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """The (rows, columns) ``scales`` in the 128 x 4 tile layout, contiguous, of shape
    ``swizzled_shape(rows, columns)``; padding holds zero bytes."""
    rows, columns = scales.shape
    row_tiles, column_tiles = -(-rows // TILE_ROWS), -(-columns // TILE_COLUMNS)
    raw = scales.contiguous().view(torch.uint8)
    padded = torch.nn.functional.pad(raw, (0, column_tiles * TILE_COLUMNS - columns, 0, row_tiles * TILE_ROWS - rows))
    # (row tile, group of 32 rows, row in group, column tile, column) -> tile-major, then
    # each tile as (row in group, group, column): 32 x (4 * 4).
    tiles = padded.view(row_tiles, _GROUPS, 32, column_tiles, TILE_COLUMNS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 32, column_tiles * 16).contiguous().view(scales.dtype)


def unswizzle(swizzled: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The (rows, columns) scales that ``swizzle`` laid out as ``swizzled``."""
    row_tiles, column_tiles = -(-rows // TILE_ROWS), -(-columns // TILE_COLUMNS)
    raw = swizzled.contiguous().view(torch.uint8)
    tiles = raw.view(row_tiles, column_tiles, 32, _GROUPS, TILE_COLUMNS).permute(0, 3, 2, 1, 4)
    plain = tiles.reshape(row_tiles * TILE_ROWS, column_tiles * TILE_COLUMNS)
    return plain[:rows, :columns].contiguous().view(swizzled.dtype)


def column_major(x: torch.Tensor) -> torch.Tensor:
    """The matrix ``x`` copied column-major: the same values and shape, strides ``(1, rows)``
    (an empty matrix's are as torch makes them).

    Compiled, it is a copy into a tensor of ``x``'s own shape, so a cast that also writes
    ``x`` row-major writes both layouts in one loop over the same elements. Eagerly it is
    a contiguous clone of ``x.t()``, transposed back: torch's transpose copy, 1.5-3x
    faster on the CPU than a copy into transposed strides (a clone, not ``contiguous()``,
    so a single row is copied to the same strides too)."""
    if not torch.compiler.is_compiling():
        return x.t().clone(memory_format=torch.contiguous_format).t()
    out = torch.empty_strided(tuple(x.shape), (1, x.shape[0]), dtype=x.dtype, device=x.device)
    return out.copy_(x)


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Append zero rows to a matrix (FP8 or not) so its row count is a multiple of
    ``multiple``."""
    missing = -x.shape[0] % multiple
    # Compiled, the zero rows (maybe none) are appended whatever the row count, so one
    # graph with symbolic sizes serves aligned and unaligned counts alike.
    if not torch.compiler.is_compiling() and missing == 0:
        return x
    # FP8 tensors are padded as their bytes (a zero byte is +0.0 in both formats).
    raw = x.view(torch.uint8) if x.element_size() == 1 and x.dtype.is_floating_point else x
    return torch.nn.functional.pad(raw, (0, 0, 0, missing)).view(x.dtype)
