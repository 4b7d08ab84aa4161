"""FP8 layers and the module swap that installs them."""

from .linear import Fp8Linear, Slot
from .swap import ModuleFilter, high_precision_reason, shared_weight_names, swap_linear_layers

__all__ = [
    "Fp8Linear",
    "ModuleFilter",
    "Slot",
    "high_precision_reason",
    "shared_weight_names",
    "swap_linear_layers",
]
