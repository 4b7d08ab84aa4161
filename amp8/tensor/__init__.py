"""The types that hold low-precision data: scaled and block-scaled tensors, a layer's
stored weight, the FP8 weight gradient and the weight shard."""

from amp8.config.validation import moved_name, removed_name
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import StoredWeight, stored_weight
from amp8.tensor.weight_grad import GradLayout, WeightGrad

_MOVED = dict.fromkeys(("is_sharded", "local_tensor"), "amp8.tensor.scaled")
"""Names of the module ``amp8.tensor`` was before it became this package, and where each is now."""


def __getattr__(name: str) -> object:
    """An old name of the module ``amp8.tensor``, with a ``DeprecationWarning`` (for one release)."""
    if name in _MOVED:
        return moved_name("amp8.tensor", name, _MOVED)
    raise removed_name("amp8.tensor", name, {}, module=True)


__all__ = ["BlockScaledTensor", "GradLayout", "ScaledTensor", "StoredWeight", "WeightGrad", "stored_weight"]
