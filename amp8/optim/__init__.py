"""Low-bit Adam / AdamW for amp8 models."""

from amp8.optim.adam import LowBitAdam
from amp8.optim.checkpoint import to_torch_state_dict
from amp8.optim.clip import clip_grad_norm_
from amp8.optim.support import SUPPORTED_OPTIMIZERS, check_state_precision, check_supported

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "LowBitAdam",
    "check_state_precision",
    "check_supported",
    "clip_grad_norm_",
    "to_torch_state_dict",
]
