"""Low-bit Adam / AdamW for amp8 models."""

from .adam import SUPPORTED_OPTIMIZERS, LowBitAdam, check_state_precision, check_supported
from .clip import clip_grad_norm_

__all__ = ["SUPPORTED_OPTIMIZERS", "LowBitAdam", "clip_grad_norm_", "check_state_precision", "check_supported"]
