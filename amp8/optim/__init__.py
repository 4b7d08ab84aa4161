"""Low-bit Adam / AdamW for amp8 models."""

from .adam import SUPPORTED_OPTIMIZERS, LowBitAdam, check_state_precision, check_supported

__all__ = ["SUPPORTED_OPTIMIZERS", "LowBitAdam", "check_state_precision", "check_supported"]
