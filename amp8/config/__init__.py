"""What the user chooses: opt levels (the precision table as data), recipes, FP8 formats,
the controller's settings, and the names of the GEMMs and their operands."""

from amp8.config.controller import ControllerConfig, HealthThresholds, Move, PrecisionPhase
from amp8.config.formats import Fp8Format
from amp8.config.gemms import Gemm, GemmOperand, Signal
from amp8.config.levels import LEVELS, OptLevel, Precision
from amp8.config.recipe import (
    ActivationFormat, AmaxAlgo, Granularity, Microscaling, MXFP8Recipe, NVFP4Recipe, OutputHead, Recipe, RecipeName,
    Scaling,
)

__all__ = [
    "LEVELS",
    "ActivationFormat",
    "AmaxAlgo",
    "ControllerConfig",
    "Fp8Format",
    "Gemm",
    "GemmOperand",
    "Granularity",
    "HealthThresholds",
    "Microscaling",
    "MXFP8Recipe",
    "NVFP4Recipe",
    "Move",
    "OptLevel",
    "OutputHead",
    "Precision",
    "PrecisionPhase",
    "Recipe",
    "RecipeName",
    "Scaling",
    "Signal",
]
