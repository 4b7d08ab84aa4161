"""Deprecated: ``amp8.comm`` is now ``amp8.distributed``; this alias goes in the next
release. Importing it (or one of its modules, e.g. ``amp8.comm.fsdp``) warns once and
gives the module under its new name."""

import importlib
import sys
import warnings

warnings.warn(
    "amp8.comm is deprecated and will be removed in the next release; import amp8.distributed instead",
    DeprecationWarning, stacklevel=2,
)

from amp8.distributed import *  # noqa: E402,F401,F403  (the old namespace, unchanged)
from amp8.distributed import __all__  # noqa: E402,F401

_MODULES = ("agreement", "buckets", "data_parallel", "ddp", "fp8_collectives", "fsdp", "layout", "reduction")
_TARGETS = {**{name: f"amp8.distributed.{name}" for name in _MODULES}, "weight_shard": "amp8.distributed.weight_shard"}
for _name, _target in _TARGETS.items():
    globals()[_name] = sys.modules[f"{__name__}.{_name}"] = importlib.import_module(_target)
