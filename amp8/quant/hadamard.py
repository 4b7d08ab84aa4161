"""The random Hadamard transform NVFP4 training applies to the weight-gradient GEMM.

wgrad contracts the token dimension: ``dW = g^T x``. Multiplying both operands along
tokens by the same orthogonal block-diagonal matrix ``Q`` leaves the product unchanged
(``(Q^T g)^T (Q^T x) = g^T x``) but spreads an outlier token's energy over its 16-token
block, so the 16-element FP4 blocks along tokens hold fewer extremes. ``Q`` repeats one
16 x 16 matrix ``H diag(signs) / 4`` (H Sylvester's Hadamard matrix, the signs drawn
from a fixed seed); layers keep it as a buffer, so it is in their ``state_dict``.
"""

from __future__ import annotations

import torch

HADAMARD_SIZE = 16
HADAMARD_SEED = 0x5EED


def random_hadamard(size: int = HADAMARD_SIZE, seed: int = HADAMARD_SEED) -> torch.Tensor:
    """An orthonormal (size, size) float32 matrix: Sylvester's Hadamard matrix with its
    columns' signs flipped at random (seeded), divided by ``sqrt(size)``.

    Raises:
        ValueError: ``size`` is not a power of two.
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Hadamard matrix of size {size} needs a power of two; use 16")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return matrix * signs.float() / size**0.5


def rotate_rows(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``Q^T x`` for the 2-D ``x`` (rows a multiple of the matrix's size) with ``Q`` the
    block-diagonal repetition of ``matrix`` along rows, in float32."""
    size = matrix.shape[0]
    if x.shape[0] % size:
        raise ValueError(f"a Hadamard transform along rows needs a multiple of {size} rows, got {x.shape[0]}; pad them")
    blocks = x.float().reshape(-1, size, x.shape[1])  # (blocks, size, C)
    return (matrix.t().to(x.device) @ blocks).reshape(x.shape)
