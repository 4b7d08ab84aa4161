"""Low-bit Adam / AdamW for amp8 models."""

from .adam import LowBitAdam
from .checkpoint import to_torch_state_dict
from .clip import clip_grad_norm_
from .support import SUPPORTED_OPTIMIZERS, check_state_precision, check_supported

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "LowBitAdam",
    "check_state_precision",
    "check_supported",
    "clip_grad_norm_",
    "to_torch_state_dict",
]
