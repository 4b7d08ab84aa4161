"""FP8 communication for data parallelism over stock torch.distributed, amp8 under
the user's ``DistributedDataParallel`` (``register_ddp``, ``fp8_compress_hook``), and
tensor-parallel styles for amp8's FP8 layers (``Fp8ColwiseParallel``, ``Fp8RowwiseParallel``)."""

from amp8.config.validation import removed_name
from amp8.distributed.comm_hook import fp8_compress_hook
from amp8.distributed.data_parallel import DataParallelGroup, broadcast_module, process_group_size
from amp8.distributed.ddp import data_parallel_group, register_ddp, register_ddp_when_wrapped
from amp8.distributed.fp8_collectives import (
    WIRE_DTYPE, WireStats, fp8_all_gather, fp8_all_reduce_mean, fp8_reduce_scatter_mean,
)
from amp8.distributed.layout import ShardLayout
from amp8.distributed.reduction import GradientReduction
from amp8.distributed.tensor_parallel import Fp8ColwiseParallel, Fp8RowwiseParallel

_REMOVED = {
    "DataParallel": "use amp8.distributed.DataParallelGroup (a process group and its byte counter); amp8.initialize "
    "builds it, and the model goes into torch's DistributedDataParallel after initialize",
}


def __getattr__(name: str) -> object:
    """Removed names fail naming what replaces them."""
    raise removed_name("amp8.distributed", name, _REMOVED, module=True)


__all__ = [
    "DataParallelGroup",
    "Fp8ColwiseParallel",
    "Fp8RowwiseParallel",
    "GradientReduction",
    "ShardLayout",
    "WIRE_DTYPE",
    "WireStats",
    "broadcast_module",
    "data_parallel_group",
    "fp8_compress_hook",
    "fp8_all_gather",
    "fp8_all_reduce_mean",
    "fp8_reduce_scatter_mean",
    "process_group_size",
    "register_ddp",
    "register_ddp_when_wrapped",
]
