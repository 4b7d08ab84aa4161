"""The three GEMMs of a linear layer, their six operands and the health signals of each
operand's cast: the names every layer of amp8 indexes by."""

from __future__ import annotations

from enum import IntEnum


class Gemm(IntEnum):
    """The three GEMMs of a linear layer; also the index of its flag in
    ``Recipe.override_linear_precision``. Only FPROP accumulates fast."""

    FPROP = 0
    DGRAD = 1
    WGRAD = 2


class GemmOperand(IntEnum):
    """One operand of one of a linear layer's GEMMs; also its row in ``health``."""

    FPROP_INPUT = 0
    FPROP_WEIGHT = 1
    DGRAD_GRAD_OUTPUT = 2
    DGRAD_WEIGHT = 3
    WGRAD_GRAD_OUTPUT = 4
    WGRAD_INPUT = 5

    @property
    def gemm(self) -> Gemm:
        """The GEMM this operand feeds."""
        return Gemm(self.value // 2)

    @property
    def label(self) -> str:
        """``"fprop input"`` and the like, for reports."""
        gemm, tensor = self.name.lower().split("_", 1)
        return f"{gemm} {tensor.replace('_', ' ')}"


class Signal(IntEnum):
    """The columns of ``health``."""

    AMAX = 0
    SATURATED = 1
    UNDERFLOW = 2
    NOISE = 3  # the cast's error power over the tensor's: its SQNR is -10 log10 of it

    @property
    def label(self) -> str:
        """``"saturated"`` and the like, for reports."""
        return self.name.lower()
