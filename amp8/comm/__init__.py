"""FP8 communication for data parallelism over stock torch.distributed."""

from .data_parallel import DataParallelGroup, broadcast_module, process_group_size
from .ddp import fp8_compress_hook
from .fp8_collectives import WIRE_DTYPE, WireStats, fp8_all_gather, fp8_all_reduce_mean, fp8_reduce_scatter_mean
from .layout import ShardLayout
from .reduction import GradientReduction
from ..validation import removed_name

_REMOVED = {
    "DataParallel": "use amp8.comm.DataParallelGroup (a process group and its byte counter); amp8.initialize "
    "builds it, and the model goes into torch's DistributedDataParallel after initialize",
}


def __getattr__(name: str) -> object:
    """Removed names fail naming what replaces them."""
    raise removed_name("amp8.comm", name, _REMOVED, module=True)


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
