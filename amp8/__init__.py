"""amp8: FP8 mixed-precision training for PyTorch, one opt level at a time.

    model, optimizer = amp8.initialize(model, optimizer, opt_level="O1")
    amp8.report(model, optimizer).print()
"""

from typing import Any

from .controller import Controller
from .controller_config import ControllerConfig, HealthThresholds, Move, PrecisionPhase
from .export import export
from .formats import Fp8Format
from .frontend import initialize
from .levels import LEVELS, OptLevel, Precision
from .optim.clip import clip_grad_norm_
from .memory import SavedBytes, count_saved_bytes
from .recipe import ActivationFormat, AmaxAlgo, Granularity, Microscaling, Recipe, RecipeName, Scaling
from .report import PrecisionReport, report
from .selection import SpeedRule
from .stored_weight import StoredWeight, stored_weight
from .weight_grad import WeightGrad

__version__ = "0.1.0"


def compare(*args: Any, **kwargs: Any) -> Any:
    """Train the same GPT at every opt level and compare them; see
    ``amp8.experiments.compare.compare`` (loaded on first use, so ``import amp8`` stays light).
    """
    from .experiments.compare import compare as run

    return run(*args, **kwargs)


__all__ = [
    "LEVELS",
    "ActivationFormat",
    "AmaxAlgo",
    "Controller",
    "ControllerConfig",
    "Fp8Format",
    "Granularity",
    "HealthThresholds",
    "Move",
    "Microscaling",
    "OptLevel",
    "Precision",
    "PrecisionPhase",
    "PrecisionReport",
    "Recipe",
    "RecipeName",
    "SavedBytes",
    "Scaling",
    "SpeedRule",
    "StoredWeight",
    "WeightGrad",
    "__version__",
    "clip_grad_norm_",
    "export",
    "compare",
    "count_saved_bytes",
    "initialize",
    "report",
    "stored_weight",
]
