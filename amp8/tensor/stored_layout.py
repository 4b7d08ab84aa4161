"""How a stored weight is encoded: the storages amp8 has for a weight (FP16 with one
power-of-two scale, FP8 at the recipe's scale tiles), and ``StorageLayout``, the part of
``amp8.tensor.stored.StoredWeight`` that answers which dtype, scales and tiles its
storage takes (``layout``, the codec every write and read goes through)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from amp8.config.formats import E4M3
from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.quant import scaling
from amp8.quant.codec import Layout, Tiling

STORAGE_DTYPES = {Precision.FP16: torch.float16, Precision.FP8: E4M3}
# Headroom of one binade above an FP16 tensor's amax, so growth between rescales fits.
FP16_MARGIN = 1


def check_storage(storage: Precision) -> None:
    """Raise ``ValueError`` unless ``storage`` is a weight storage amp8 has (FP16 or FP8
    with a scale, or ``AS_IS``: the Parameter's own dtype, no scale)."""
    if storage not in STORAGE_DTYPES and storage is not Precision.AS_IS:
        allowed = [p.value for p in (*STORAGE_DTYPES, Precision.AS_IS)]
        raise ValueError(f"weight_storage={storage!r} is not valid; use one of {allowed}")


FP16_LAYOUT = Layout(torch.float16, Tiling.TENSOR, margin=FP16_MARGIN, power_of_2=True, stream=0)
"""How the FP16 weights of O1/O2 and O3's FP16 master weights are stored: one power-of-two
scale with a binade of headroom, rounded stochastically in an optimizer's update (noise
field 0 of its words)."""


def encode_fp16(value: torch.Tensor, words: torch.Tensor | None = None,
                previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(FP16 data, scale)`` for float ``value`` at ``FP16_LAYOUT``, rounded
    stochastically under ``words`` (``amp8.quant.noise.update_words``) where given."""
    data, scale = FP16_LAYOUT.encode(value, words=words, previous=previous)
    assert scale is not None
    return data, scale


class StorageLayout:
    """The storage format of ``StoredWeight`` (see its class docstring): dtypes, scale
    tiles and the codec layout, from its recipe and storage."""

    recipe: Recipe
    storage: Precision
    fixed_storage: bool
    sharded: bool

    if TYPE_CHECKING:  # defined by StoredWeight
        @property
        def param(self) -> nn.Parameter: ...

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype the scales are stored in: the recipe's ``stored_scale_dtype`` for FP8
        storage (E8M0 under MXFP8), else float32."""
        return self.recipe.stored_scale_dtype if self.storage is Precision.FP8 else torch.float32

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weight is stored in (float16, float8_e4m3fn, or the Parameter's
        own dtype for ``AS_IS``)."""
        return self.param.dtype if self.storage is Precision.AS_IS else STORAGE_DTYPES[self.storage]

    @property
    def block_size(self) -> int:
        """Elements per block edge of the weight's scales (0 unless the recipe is "block")."""
        return self.recipe.scale_block_size

    def tile(self, contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile of the weight's FP8 scales for a GEMM contracting its dim
        ``contract_dim`` (1: the forward GEMM, 0: the input-gradient GEMM); each expert's
        own tiles for a stack of experts' matrices."""
        shape = tuple(self.param.shape)
        return scaling.matrix_tile(self.recipe.tile(shape[-2:], contract_dim, weight=True), shape)

    def state_tile(self) -> tuple[int, int] | None:
        """The tile of the scales of Adam's FP8 first moment of this weight: the tiles of
        the weight's FP8 scales, or one per row for a weight of fixed storage and for a
        stack of experts' matrices that takes one scale per expert."""
        shape = tuple(self.param.shape)
        tile = self.tile()
        if self.sharded:  # the optimizer keeps a sharded weight's state as flat chunks, in blocks
            return None
        if self.fixed_storage or (len(shape) > 2 and tile == shape[-2:]):
            return (1, shape[-1])
        return tile

    def state_scale_dtype(self) -> torch.dtype:
        """The dtype of those first-moment scales: the recipe's ``stored_scale_dtype`` at
        the weight's tiles (E8M0 under MXFP8), float32 per row for fixed storage."""
        return torch.float32 if self.fixed_storage else self.recipe.stored_scale_dtype

    @property
    def layout(self) -> Layout:
        """How the stored data encode the weight (``amp8.quant.codec``): FP16 with one
        power-of-two scale, or FP8 at the recipe's scale tiles; float32 as is for
        ``AS_IS`` storage."""
        if self.storage is Precision.FP16:
            return FP16_LAYOUT
        if self.storage is not Precision.FP8:
            return Layout()
        recipe = self.recipe
        return Layout.for_tile(self.dtype, self.tile(), tuple(self.param.shape), margin=recipe.margin,
                               power_of_2=recipe.power_of_2_scales, scale_dtype=self.scale_dtype)
