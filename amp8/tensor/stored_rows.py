"""``LocalRows``: the part of ``amp8.tensor.stored.StoredWeight`` that knows which rows
of a weight FSDP2 shards this rank stores, and their share of the whole weight's scales
and amaxes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.quant import scaling
from amp8.tensor.scaled import is_sharded, local_tensor


class LocalRows:
    """The rows this rank stores of ``StoredWeight``'s weight (see its class docstring):
    all of them where the weight is not sharded."""

    storage: Precision

    if TYPE_CHECKING:  # defined by StoredWeight and StorageLayout
        @property
        def param(self) -> nn.Parameter: ...

        def tile(self, contract_dim: int = 1) -> tuple[int, int] | None: ...

    def local_rows(self) -> tuple[int, int]:
        """``[start, end)`` of the rows (dim 0) this rank stores: FSDP2 gives each rank
        ``ceil(rows / ranks)`` rows in rank order; all of them where not sharded."""
        param = self.param
        rows = local_tensor(param).shape[0]
        if not is_sharded(param):
            return 0, rows
        start = min(param.device_mesh.get_local_rank() * -(-param.shape[0] // param.device_mesh.size()), param.shape[0])
        return start, start + rows

    def _scale_of_rows(self, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The scales of ``rows`` (this rank's rows of the weight) among the whole
        weight's ``scale``: those of its experts, for a stack with scales per expert
        sharded over ranks; else ``scale`` itself."""
        if scale.dim() == 0 or not is_sharded(self.param):
            return scale
        start, end = self.local_rows()
        return scale[start:end]

    def amax_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The amaxes this rank's ``rows`` of a sharded weight add to the whole weight's
        (taken as the max over ranks): one for a weight with one scale; for a stack of
        experts with one scale per expert, one per expert of the whole stack, zero for
        the experts other ranks hold."""
        if self.storage is not Precision.FP8 or len(self.param.shape) < 3 or self.tile() is None:
            return rows.abs().amax() if rows.numel() else rows.new_zeros(())
        whole = rows.new_zeros((self.param.shape[0], 1, 1))
        start, end = self.local_rows()
        if end > start:
            whole[start:end] = scaling.tile_amax(rows, self.tile())
        return whole
