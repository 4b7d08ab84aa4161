"""FP8 layers (linear, embedding, experts) and the module swap that installs them."""

from amp8.config.validation import removed_name
from amp8.nn.adapters import adapter_modules, register_lora
from amp8.nn.compiled_casts import set_compiled_casts
from amp8.nn.embedding import LowBitEmbedding
from amp8.nn.experts import Fp8Experts
from amp8.nn.experts_layout import ExpertsLayout
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import CastRule, LinearQuantizers, Quantizer, TensorRole
from amp8.nn.single_weight import SingleStoredWeightModule
from amp8.nn.swap import (
    ModuleFilter, embedding_reason, high_precision_reason, shared_weight_names, swap_embeddings, swap_experts,
    swap_linear_layers,
)

_REMOVED = {
    "Slot": "use amp8.nn.TensorRole (INPUT, WEIGHT, GRAD_OUTPUT), which Fp8Linear.cast and friends take",
    "StoredWeightModule": "renamed amp8.nn.SingleStoredWeightModule (the base of the layers with one stored weight)",
}


def __getattr__(name: str) -> object:
    """Removed names fail naming what replaces them."""
    raise removed_name("amp8.nn", name, _REMOVED, module=True)


__all__ = [
    "CastRule",
    "ExpertsLayout",
    "Fp8Experts",
    "Fp8Linear",
    "LinearQuantizers",
    "LowBitEmbedding",
    "ModuleFilter",
    "Quantizer",
    "SingleStoredWeightModule",
    "TensorRole",
    "adapter_modules",
    "embedding_reason",
    "high_precision_reason",
    "register_lora",
    "set_compiled_casts",
    "shared_weight_names",
    "swap_embeddings",
    "swap_experts",
    "swap_linear_layers",
]
