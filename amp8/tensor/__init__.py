"""The types that hold low-precision data: scaled and block-scaled tensors, a layer's
stored weight, the FP8 weight gradient and the weight shard."""

from amp8.config.validation import removed_name
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import StoredWeight, stored_weight
from amp8.tensor.weight_grad import GradLayout, WeightGrad

_REMOVED = {name: f"import it from amp8.tensor.scaled ({name} is there)" for name in ("is_sharded", "local_tensor")}
"""Names of the module ``amp8.tensor`` was before it became this package, and where each is now."""


def __getattr__(name: str) -> object:
    """The error for a missing name, naming where an old one of ``amp8.tensor`` is now."""
    raise removed_name("amp8.tensor", name, _REMOVED, module=True)


__all__ = ["BlockScaledTensor", "GradLayout", "ScaledTensor", "StoredWeight", "WeightGrad", "stored_weight"]
