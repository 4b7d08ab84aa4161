"""``ScaledTensor``: low-precision data with the scale that gives back its real values.

It is a plain container, not a ``torch.Tensor`` look-alike: code that wants real values
asks for them with ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import scaling


@dataclass(frozen=True)
class ScaledTensor:
    """``data`` holds ``x * scale`` in a low-precision dtype; ``scale`` is float32.

    ``scale`` is a scalar for tensorwise scaling; finer granularities broadcast against
    ``data``.
    """

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_float(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype,
        *,
        margin: int = 0,
        power_of_2: bool = False,
    ) -> "ScaledTensor":
        """Quantize ``x`` to ``dtype`` with a fresh scale from its own amax."""
        scale = scaling.scale_from_amax(
            scaling.amax(x), dtype, margin=margin, power_of_2=power_of_2
        )
        return cls(scaling.quantize(x, scale, dtype), scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values, ``data / scale``, in ``dtype``."""
        return scaling.dequantize(self.data, self.scale, dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of ``data``."""
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape of ``data``."""
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: the data plus its scales."""
        return self.data.nbytes + self.scale.nbytes
