"""FP8 communication for data parallelism over stock torch.distributed."""

from .data_parallel import DataParallelGroup, broadcast_module, process_group_size
from .ddp import fp8_compress_hook
from .fp8_collectives import WIRE_DTYPE, WireStats, fp8_all_gather, fp8_all_reduce_mean, fp8_reduce_scatter_mean
from .layout import ShardLayout
from .reduction import GradientReduction

__all__ = [
    "DataParallelGroup",
    "GradientReduction",
    "ShardLayout",
    "WIRE_DTYPE",
    "WireStats",
    "broadcast_module",
    "fp8_compress_hook",
    "fp8_all_gather",
    "fp8_all_reduce_mean",
    "fp8_reduce_scatter_mean",
    "process_group_size",
]
