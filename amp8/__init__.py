"""amp8: FP8 mixed-precision training for PyTorch, one opt level at a time.

    model, optimizer = amp8.initialize(model, optimizer, opt_level="O1")
    amp8.report(model, optimizer).print()

The names below are amp8's public, stable API. Everything else lives in its layer's
subpackage (``amp8.config``, ``amp8.nn``, ``amp8.optim``, ``amp8.distributed``,
``amp8.monitor``, ...), importable but free to change between minor releases.
"""

import importlib
from typing import Any

from amp8 import _old_paths
from amp8._version import __version__
from amp8.config.controller import ControllerConfig
from amp8.config.levels import LEVELS, OptLevel
from amp8.config.recipe import Recipe
from amp8.config.validation import moved_name
from amp8.export import export
from amp8.frontend import initialize
from amp8.monitor.controller import Controller
from amp8.monitor.operand_health import watch_operands
from amp8.monitor.report import report
from amp8.monitor.report_log import ReportLog
from amp8.monitor.what_if import what_if
from amp8.nn.memory import count_saved_bytes
from amp8.nn.state_dict_form import compact_state_dict
from amp8.optim.clip import clip_grad_norm_


MOVED = {
    **dict.fromkeys(
        ("ActivationFormat", "AmaxAlgo", "Fp8Format", "Granularity", "HealthThresholds", "Microscaling", "Move",
         "Precision", "PrecisionPhase", "RecipeName", "Scaling"), "amp8.config"),
    "PrecisionReport": "amp8.monitor",
    "SavedBytes": "amp8.nn.memory",
    "SpeedRule": "amp8.nn.selection",
    "StoredWeight": "amp8.tensor",
    "WeightGrad": "amp8.tensor",
    "stored_weight": "amp8.tensor",
}
"""Names the top level held before 0.2, and the subpackage that holds each now."""


def compare(*args: Any, **kwargs: Any) -> Any:
    """Train the same model at every opt level and compare them; see
    ``amp8.tools.experiments.compare.compare`` (loaded on first use, so ``import amp8``
    stays light)."""
    from amp8.tools.experiments.compare import compare as run

    return run(*args, **kwargs)


_old_paths.install()  # ``import amp8.scaling`` and amp8's other old module paths (see amp8/_old_paths.py)


def __getattr__(name: str) -> Any:
    """A name that moved to a subpackage, or an old module (``amp8.scaling``), with a
    ``DeprecationWarning`` naming its new home (for one release); a gone module fails
    naming what to import instead."""
    if name in MOVED:
        return moved_name("amp8", name, MOVED)
    old = f"amp8.{name}"
    home = _old_paths.moved_home(old)
    if home is not None:
        _old_paths.warn_moved(old, home, stacklevel=2)
        return importlib.import_module(home)
    error = _old_paths.gone_error(old)
    if error is not None:
        raise error
    raise AttributeError(f"module 'amp8' has no attribute {name!r}")


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
