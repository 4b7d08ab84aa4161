"""FP8 layers and the module swap that installs them."""

from .linear import Fp8Linear
from .quantizer import CastRule, LinearQuantizers, Quantizer, TensorRole
from .swap import ModuleFilter, high_precision_reason, shared_weight_names, swap_linear_layers

__all__ = [
    "CastRule",
    "Fp8Linear",
    "LinearQuantizers",
    "ModuleFilter",
    "Quantizer",
    "TensorRole",
    "high_precision_reason",
    "shared_weight_names",
    "swap_linear_layers",
]
