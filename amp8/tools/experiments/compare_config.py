"""What one ``amp8 compare`` call trains: its configuration and the runs it makes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from amp8.config.controller import ControllerConfig
from amp8.config.levels import LEVELS, OptLevel
from amp8.config.recipe import Recipe
from amp8.tools.experiments import llama
from amp8.tools.experiments.corpus import CorpusConfig
from amp8.tools.experiments.gpt import PRESETS, GPTConfig
from amp8.tools.experiments.llama import LlamaSpec
from amp8.tools.experiments.stress import OutlierStress

ABLATION = "O1-noscale"
KNOB_ABLATIONS = {"wgrad_hadamard": "O1-no-hadamard", "stochastic_grad_rounding": "O1-no-sr"}
"""Under a microscaled recipe, each of these knobs that is on gets an O1 run without it
(named by the value) in place of the no-scaling ablation."""
TORCHAO = "torchao"
TORCHAO_RUNS = {"tensorwise": TORCHAO, "rowwise": "torchao-rowwise"}
"""torchao's float8 recipes that compare trains, and the name of each run."""
JSON_NAME = "compare.json"
DEFAULT_OUT = "runs/compare"
PNG_NAME = "loss_curves.png"
_VAL_SEED = 1234  # the validation windows are the same for every run and seed
MODELS = ("gpt", "gpt-tied", "llama", "moe")
"""The models ``model_config`` shapes by name: the GPT with an output head of its own (as
most Llama-style models have; the default), the GPT with its head tied to the token
embedding (which never runs in FP8), a byte-level Llama from transformers, and its
mixture-of-experts sibling, a Mixtral with ``MOE_EXPERTS`` experts, ``MOE_TOP_K`` a token."""
MOE_EXPERTS = 8
MOE_TOP_K = 2


def model_config(name: str, preset: str = "small", **shape: int) -> GPTConfig | LlamaSpec:
    """The shape of model ``name`` (one of ``MODELS``) at the GPT preset ``preset``, with
    ``shape`` (``n_layer``, ``n_embd``, ``n_head``, ``block_size``) overriding the
    preset's; the Llama and the Mixtral take those four and size the rest
    (``LlamaSpec.of_shape``), the Mixtral's experts each as wide as the Llama's MLP.

    Raises:
        ValueError: an unknown name or preset, or a shape that is not valid.
        ModuleNotFoundError: "llama" or "moe" without transformers installed, saying how to get it.
    """
    if name not in MODELS:
        raise ValueError(f"model {name!r} is not known; use one of {', '.join(map(repr, MODELS))}")
    gpt = dataclasses.replace(GPTConfig.from_preset(preset), tie_head=name == "gpt-tied", **shape)
    if name not in ("llama", "moe"):
        return gpt
    if not llama.transformers_available():
        family = "LlamaForCausalLM" if name == "llama" else "MixtralForCausalLM"
        raise ModuleNotFoundError(
            f"the {name!r} model is transformers' {family} and transformers is not installed; "
            "install it with pip install 'amp8[hf]', or pick the 'gpt' model"
        )
    spec = LlamaSpec.of_shape(gpt.n_layer, gpt.n_head, gpt.n_embd, gpt.block_size)
    return dataclasses.replace(spec, n_expert=MOE_EXPERTS, expert_top_k=MOE_TOP_K) if name == "moe" else spec


@dataclass(frozen=True)
class CompareConfig:
    """What ``compare`` trains and how.

    Attributes:
        model: the model: a GPT's shape (``GPTConfig``; see ``amp8.tools.experiments.gpt.PRESETS``)
            or a byte-level Llama's or Mixtral's (``LlamaSpec``, needs transformers). The default is
            the "small" GPT with an untied output head, as most Llama-style models have:
            a tied head shares the embedding's weight and never runs in FP8.
        steps: optimizer steps per run.
        batch_size: sequences per step.
        lr: peak learning rate (linear warm-up, cosine decay to ``lr * min_lr_ratio``).
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        warmup_steps: steps of linear warm-up.
        weight_decay: AdamW decay of matrices (biases, norms and positions are not decayed).
        levels: opt levels to train, names from ``amp8.LEVELS``; must include "O0".
        ablation: also train O1 with ``Recipe(scaling="none")``.
        torchao: also train torchao's float8 when torchao is importable.
        seeds: how many seeds to train from (``seed, seed + 1, ...``, see ``run_seeds``).
            With more than one, every level, the torchao runs and the null variant (O0
            from initial weights perturbed by 1e-6, ``paired.null_variant``) train from
            each, paired with O0 by seed; the ablations and controller runs train from
            ``seed`` only.
        seed: the first seed of the model's initial weights and of the batch order.
        eval_interval: steps between validation-loss evaluations on the curve.
        eval_batches: batches of the fixed validation set.
        train_loss_window: the final train loss is the mean of this many last steps.
        device: "cpu" or "cuda" (any torch device string).
        corpus: which bytes to train on.
        recipe: the FP8 recipe of the O1-O3 runs (the ablation takes it with no scaling;
            O0 ignores it, FP8 activations included); None for ``amp8.initialize``'s
            default, whatever it is in this version of amp8.
        stress: an outlier injected into every run, O0 included, with its position left
            out of the training and validation loss (see ``amp8.tools.experiments.stress``);
            None for none.
        controller_levels: FP8 levels to train once more with an ``amp8.Controller``
            (runs named ``<level>+controller``).
        controller: the settings of those runs' controllers.
        threshold_percent: the largest gap to O0 (in percent of O0's final validation
            loss) at which a level is still recommended (``CompareResult.recommended``).
    """

    model: GPTConfig | LlamaSpec = dataclasses.replace(PRESETS["small"], tie_head=False)
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    levels: tuple[str, ...] = tuple(LEVELS)
    ablation: bool = True
    torchao: bool = True
    seeds: int = 1
    seed: int = 0
    eval_interval: int = 50
    eval_batches: int = 16
    train_loss_window: int = 20
    device: str = "cpu"
    corpus: CorpusConfig = CorpusConfig()
    recipe: Recipe | None = None
    stress: OutlierStress | None = None
    controller_levels: tuple[str, ...] = ()
    controller: ControllerConfig = ControllerConfig()
    threshold_percent: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "controller_levels", tuple(self.controller_levels))
        for name in ("steps", "batch_size", "seeds", "eval_interval", "eval_batches", "train_loss_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CompareConfig.{name}={value!r} is not valid; use an int >= 1")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"CompareConfig.warmup_steps={self.warmup_steps!r} is not valid; use an int >= 0")
        if not 0 < self.lr < math.inf or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"CompareConfig lr={self.lr}, min_lr_ratio={self.min_lr_ratio} are not valid; "
                "use a finite lr > 0 and 0 <= min_lr_ratio <= 1"
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"CompareConfig.weight_decay={self.weight_decay!r} is not valid; use a finite float >= 0")
        check_threshold_and_seed("CompareConfig.", self.threshold_percent, self.seed)
        for name, kinds in (
            ("model", (GPTConfig, LlamaSpec)), ("corpus", (CorpusConfig,)), ("recipe", (Recipe, type(None))),
            ("controller", (ControllerConfig,)),
        ):
            if not isinstance(getattr(self, name), kinds):
                expected = " or ".join("None" if kind is type(None) else kind.__name__ for kind in kinds)
                raise TypeError(f"CompareConfig.{name} must be a {expected}, got {type(getattr(self, name)).__name__}")
        if self.stress is not None:
            if not isinstance(self.stress, OutlierStress):
                raise TypeError(f"CompareConfig.stress must be an OutlierStress or None, got {type(self.stress).__name__}")
            if not isinstance(self.model, GPTConfig):
                raise ValueError("CompareConfig.stress needs the GPT (it hooks the last block's MLP); use a GPTConfig model")
            self.stress.check_model(self.model)
        check_device_and_levels("CompareConfig.", self.device, self.levels)
        not_fp8 = [level for level in self.controller_levels if level not in LEVELS or level == "O0"]
        if not_fp8:
            raise ValueError(
                f"CompareConfig.controller_levels has {', '.join(map(repr, not_fp8))}; a controller "
                "watches FP8 layers, so use levels among 'O1', 'O2', 'O3'"
            )
        if "O0" not in self.levels:
            raise ValueError(
                f"CompareConfig.levels={self.levels} lacks 'O0'; every gap is measured against O0, "
                "so include it"
            )

    def replace(self, **changes: Any) -> "CompareConfig":
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds the levels train from: ``seed, seed + 1, ...``, ``seeds`` of them."""
        return tuple(range(self.seed, self.seed + self.seeds))

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        warmup = min(self.warmup_steps, self.steps // 5)  # short runs keep most steps for decay
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - 1 - warmup)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


def check_device_and_levels(owner: str, device: Any, levels: Any) -> None:
    """Raise unless ``device`` is one amp8 can train on and every one of ``levels`` is an
    opt level's name; ``owner`` as in ``check_threshold_and_seed``."""
    _check_device(device)
    unknown = [level for level in levels if level not in LEVELS]
    if unknown:
        raise ValueError(
            f"{owner}levels has {', '.join(map(repr, unknown))}, not amp8 opt levels; "
            f"use names from {', '.join(map(repr, LEVELS))}"
        )


def check_threshold_and_seed(owner: str, threshold_percent: Any, seed: Any) -> None:
    """Raise ``ValueError`` naming ``owner`` (the config's name and a dot, or "compare ")
    unless ``threshold_percent`` is a finite number >= 0 and ``seed`` an int in
    ``[0, 2**63)``."""
    if isinstance(threshold_percent, bool) or not isinstance(threshold_percent, (int, float)) \
            or not 0 <= threshold_percent < math.inf:
        raise ValueError(
            f"{owner}threshold_percent={threshold_percent!r} is not valid; use a finite number >= 0 "
            "(percent of O0's final loss, e.g. 0.5)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{owner}seed={seed!r} is not valid; use an int in [0, 2**63)")


def _check_device(device: object) -> None:
    """Raise ``ValueError`` unless ``device`` names a torch device this machine has."""
    try:
        parsed = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ValueError(
            f"CompareConfig.device={device!r} is not a torch device; use e.g. 'cpu' or 'cuda'"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"CompareConfig.device={device!r} is not available: this torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use 'cpu'"
        )


@dataclass(frozen=True)
class RunSpec:
    """One run: its name, opt level (a name, or an ``OptLevel`` such as
    ``amp8.config.levels.override("O2", exp_avg="fp32")``), recipe (None for ``amp8.initialize``'s
    default) and seed, or torchao's float8.

    ``init_perturbation``: when > 0, every initial weight is multiplied by
    ``1 + init_perturbation * N(0, 1)`` (noise drawn from a fixed generator) before
    training: an O0 run so perturbed measures how far two runs drift apart from a
    difference of rounding size alone.

    ``controller``: when given, the run trains with an ``amp8.Controller`` of these
    settings (a fresh one per run).

    ``torchao_recipe``: torchao's float8 recipe of a ``torchao`` run ("tensorwise" or
    "rowwise").
    """

    name: str
    level: str | OptLevel
    seed: int
    recipe: Recipe | None = None
    torchao: bool = False
    init_perturbation: float = 0.0
    controller: ControllerConfig | None = None
    torchao_recipe: str = "tensorwise"
