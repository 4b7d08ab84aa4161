"""The types that hold low-precision data: scaled and block-scaled tensors, a layer's
stored weight, the FP8 weight gradient and the weight shard."""

from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.stored import StoredWeight, stored_weight
from amp8.tensor.weight_grad import GradLayout, WeightGrad

__all__ = ["BlockScaledTensor", "GradLayout", "ScaledTensor", "StoredWeight", "WeightGrad", "stored_weight"]
