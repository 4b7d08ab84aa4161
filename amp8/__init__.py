"""amp8: FP8 mixed-precision training for PyTorch, one opt level at a time.

    model, optimizer = amp8.initialize(model, optimizer, opt_level="O1")
    amp8.report(model, optimizer).print()

The names below (``amp8.__all__``) are amp8's public, stable API:

- ``initialize``: apply an opt level to a model and its optimizer;
- ``OptLevel``, ``LEVELS``: one row of the precision table, and the table by name;
- ``Recipe``: how the FP8 layers scale and cast their tensors;
- ``report``, ``ReportLog``, ``watch_operands``, ``what_if``: what every tensor really
  stores, over a run, each GEMM operand's health, and what other recipes would give;
- ``Controller``, ``ControllerConfig``: the precision controller and its settings;
- ``clip_grad_norm_``: gradient clipping that also reaches O3's sharded FP8 gradients;
- ``compact_state_dict``, ``export``: amp8's bit-exact checkpoint form, and a plain copy
  of the model;
- ``count_saved_bytes``: the bytes autograd saves for backward;
- ``compare``: the same model trained at every opt level, compared;
- ``__version__``: amp8's version.

Everything else lives in its layer's subpackage (``amp8.config``, ``amp8.nn``,
``amp8.optim``, ``amp8.distributed``, ``amp8.monitor``, ...), importable but free to
change between minor releases.
"""

from typing import Any

from amp8._version import __version__
from amp8.config.controller import ControllerConfig
from amp8.config.levels import LEVELS, OptLevel
from amp8.config.recipe import Recipe
from amp8.export import export
from amp8.frontend import initialize
from amp8.monitor.controller import Controller
from amp8.monitor.operand_health import watch_operands
from amp8.monitor.report import report
from amp8.monitor.report_log import ReportLog
from amp8.monitor.what_if import what_if
from amp8.nn.memory import count_saved_bytes
from amp8.nn.stored_weights import compact_state_dict
from amp8.optim.clip import clip_grad_norm_


def compare(*args: Any, **kwargs: Any) -> Any:
    """Train the same model at every opt level and compare them; see
    ``amp8.tools.experiments.compare.compare`` (loaded on first use, so ``import amp8``
    stays light)."""
    from amp8.tools.experiments.compare import compare as run

    return run(*args, **kwargs)


__all__ = [
    "LEVELS",
    "Controller",
    "ControllerConfig",
    "OptLevel",
    "Recipe",
    "ReportLog",
    "__version__",
    "clip_grad_norm_",
    "compare",
    "compact_state_dict",
    "count_saved_bytes",
    "export",
    "initialize",
    "report",
    "watch_operands",
    "what_if",
]
