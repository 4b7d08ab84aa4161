"""The settings of one tensor role's FP8 cast: ``TensorRole`` and ``CastRule``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from amp8.config.formats import FP4, forward_dtype, gradient_dtype
from amp8.config.recipe import AmaxAlgo, Granularity, Microscaling, Recipe, Scaling, operand_tile
from amp8.quant import scaling


class TensorRole(IntEnum):
    """The role of a tensor in an ``Fp8Linear``'s GEMMs; also its row in the layer's
    ``scale`` and ``amax_history`` buffers."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


@dataclass(frozen=True)
class CastRule:
    """Everything about one role's FP8 cast except its tensors.

    Attributes:
        dtype: the FP8 dtype of the cast.
        scaling: where the scale comes from (see ``amp8.config.Scaling``).
        margin: scales are divided by ``2**margin``.
        power_of_2: scales are rounded down to a power of two.
        amax_algo: how delayed scaling reduces the amax history.
        granularity: how many scales a cast takes (see ``amp8.config.Granularity``).
        block_size: the recipe's tile edge under "block".
        square_blocks: the role takes ``block_size`` squares under "block" (weights).
        microscaled: casts give ``BlockScaledTensor`` in the microscaled format of
            ``dtype`` (MXFP8 for FP8, NVFP4 for packed FP4).
        stochastic: microscaled FP4 casts round stochastically (output gradients).
    """

    dtype: torch.dtype
    scaling: Scaling
    margin: int
    power_of_2: bool
    amax_algo: AmaxAlgo
    granularity: Granularity
    block_size: int
    square_blocks: bool
    microscaled: bool = False
    stochastic: bool = False

    @classmethod
    def for_role(cls, recipe: Recipe, role: TensorRole) -> "CastRule":
        """The rule ``recipe`` gives the tensor in ``role``: E5M2 for output gradients
        under HYBRID, E4M3 otherwise."""
        fmt = recipe.fp8_format
        dtype = gradient_dtype(fmt) if role is TensorRole.GRAD_OUTPUT else forward_dtype(fmt)
        return cls(
            dtype=FP4 if recipe.microscaling is Microscaling.NVFP4 else dtype,
            scaling=recipe.scaling,
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
            amax_algo=recipe.amax_compute_algo,
            granularity=recipe.granularity,
            block_size=recipe.block_size,
            square_blocks=role is TensorRole.WEIGHT and recipe.square_weight_blocks,
            microscaled=recipe.microscaling is not Microscaling.NONE,
            stochastic=recipe.stochastic_grad_rounding and role is TensorRole.GRAD_OUTPUT,
        )

    @property
    def scale_block_size(self) -> int:
        """Elements per block edge of the scales a cast gives (0 unless "block")."""
        return self.block_size if self.granularity is Granularity.BLOCK else 0

    def tile(self, shape: tuple[int, ...], contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile sharing one scale when a tensor of ``shape`` is cast for a GEMM
        contracting its dim ``contract_dim``; None for one scale per tensor."""
        return operand_tile(self.granularity, self.block_size, shape, contract_dim, weight=self.square_blocks)

    def scale_from_amax(self, amax: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The scales for ``amax`` (elementwise), keeping ``previous`` (default 1) where an
        amax is zero or not finite."""
        return scaling.scale_from_amax(
            amax, self.dtype, margin=self.margin, power_of_2=self.power_of_2, previous=previous
        )
