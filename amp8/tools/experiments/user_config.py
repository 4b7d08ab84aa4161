"""What ``amp8.compare(model=..., data=...)`` trains: the user's own model, optimizer,
batches and loss, and how the comparison runs them (``UserCompareConfig``).

The built-in form (``CompareConfig``: amp8's GPT, Llama or Mixtral on its own corpora)
lives in ``compare_config.py``; this is its counterpart for any ``nn.Module``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from amp8.config.levels import LEVELS
from amp8.config.recipe import Recipe
from amp8.tools.experiments.compare_config import check_device_and_levels, check_threshold_and_seed

DEFAULT_THRESHOLD_PERCENT = 0.5
"""The largest gap to O0, in percent of O0's final loss, at which a level is still
recommended (``UserCompareConfig.threshold_percent``, ``CompareConfig.threshold_percent``)."""

ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFunction = Callable[[nn.Module, Any], torch.Tensor]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def describe_callable(value: object) -> str:
    """A short name for a callable or object, for tables and JSON: ``module.qualname``
    of a function or class, the class name of an instance."""
    if value is None:
        return "default"
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    module = getattr(value, "__module__", None)
    if isinstance(name, str):
        return f"{module}.{name}" if module and module != "builtins" else name
    return type(value).__name__


def is_reiterable(data: object) -> bool:
    """Whether ``data`` gives a fresh pass each time it is iterated (a list, a
    ``DataLoader``, a ``Dataset`` with ``__iter__``): an iterator or generator, which is
    its own iterator, does not."""
    if not isinstance(data, collections.abc.Iterable):
        return False
    return not isinstance(data, collections.abc.Iterator)


def _check_data(name: str, data: object) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``data`` is a re-iterable of batches
    (or a callable that returns one) that is not known to be empty."""
    if isinstance(data, nn.Module):
        raise TypeError(f"{name} is an nn.Module ({type(data).__name__}); pass the batches (a list, a DataLoader), "
                        "and the model as model=")
    if callable(data) and not isinstance(data, collections.abc.Iterable):
        return  # a factory of batches: called once per run
    if isinstance(data, collections.abc.Iterator):
        raise TypeError(
            f"{name} is an iterator ({type(data).__name__}), which can be read only once, but every level "
            f"must see the same batches in the same order; pass a list of batches, a DataLoader, or a "
            f"function that returns a fresh iterator (e.g. {name}=lambda: make_batches())"
        )
    if not isinstance(data, collections.abc.Iterable):
        raise TypeError(
            f"{name} must be a re-iterable of batches (a list, a DataLoader) or a function returning one, "
            f"got {type(data).__name__}"
        )
    if isinstance(data, collections.abc.Sized) and len(data) == 0:
        raise ValueError(f"{name} holds no batches (len 0); give it at least one batch")


@dataclass(frozen=True)
class UserCompareConfig:
    """What ``amp8.compare(model=..., data=...)`` trains and how.

    Attributes:
        model: a callable that returns a fresh ``nn.Module`` (called once per seed, under
            that seed, so seeds differ in their initial weights), or an ``nn.Module``
            (deep-copied for every run; the original is never trained). Each seed's
            model is copied for every level, so the levels of a seed start from the
            same weights.
        data: the training batches: a re-iterable (a list, a ``DataLoader``) or a
            function that returns a fresh iterable; every run reads it from the start
            with the random generators seeded alike, so every level sees the same batches
            in the same order. Read again from the start when it holds fewer than
            ``steps`` batches.
        optimizer: ``params -> torch.optim.Optimizer``; None for ``torch.optim.AdamW``
            with torch's defaults. O1-O3 need Adam or AdamW (``amp8.initialize``); a
            level that refuses the optimizer is reported as failed.
        loss: ``(model, batch) -> scalar tensor``; None for ``model(**batch).loss`` when
            a batch is a mapping, else ``model(batch)``, its ``.loss`` when it has one.
        eval_data: validation batches (re-iterable, as ``data``), or None; with them the
            validation loss is measured every ``eval_interval`` steps and at the end, and
            the gaps to O0 are of the final validation loss; without them, of the final
            train loss (the mean of the last ``train_loss_window`` steps).
        scheduler: ``optimizer -> learning-rate scheduler`` stepped after every optimizer
            step (built after ``amp8.initialize``, on the optimizer it returns), or None.
        steps: optimizer steps per run; None for one pass over ``data`` (which then
            needs a ``len``).
        levels: opt levels to train, names from ``amp8.LEVELS``; must include "O0".
        seeds: how many seeds (``seed, seed + 1, ...``); with more than one every level
            and the null variant ``O0-null`` train from each, paired with O0 by seed.
        seed: the first seed.
        eval_interval: steps between validation-loss evaluations; None for a fifth of
            ``steps``.
        train_loss_window: the final train loss is the mean of this many last steps.
        device: the torch device to train on ("cpu", "cuda"); batches are moved there.
        recipe: the FP8 recipe of the O1-O3 runs; None for ``amp8.initialize``'s default.
        threshold_percent: the largest gap to O0 (in percent) at which a level is still
            recommended.
        name: what the table calls the model; None for the class name of the model.
    """

    model: nn.Module | ModelFactory
    data: Any
    optimizer: OptimizerFactory | None = None
    loss: LossFunction | None = None
    eval_data: Any = None
    scheduler: SchedulerFactory | None = None
    steps: int | None = None
    levels: tuple[str, ...] = tuple(LEVELS)
    seeds: int = 1
    seed: int = 0
    eval_interval: int | None = None
    train_loss_window: int = 20
    device: str = "cpu"
    recipe: Recipe | None = None
    threshold_percent: float = DEFAULT_THRESHOLD_PERCENT
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if not isinstance(self.model, nn.Module) and not callable(self.model):
            raise TypeError(
                f"model must be an nn.Module or a function that returns a fresh one, got {type(self.model).__name__}"
            )
        _check_data("data", self.data)
        if self.eval_data is not None:
            _check_data("eval_data", self.eval_data)
        for name in ("optimizer", "loss", "scheduler"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a function (see amp8.compare's docstring) or None, got "
                                f"{type(value).__name__}")
        if self.steps is None:
            if not isinstance(self.data, collections.abc.Sized):
                raise ValueError(
                    f"steps=None means one pass over data, but data ({type(self.data).__name__}) has no len(); "
                    "pass steps=N"
                )
            object.__setattr__(self, "steps", len(self.data))
        for name in ("steps", "seeds", "train_loss_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"compare {name}={value!r} is not valid; use an int >= 1")
        if self.eval_interval is None:
            object.__setattr__(self, "eval_interval", max(1, self.steps // 5))  # type: ignore[operator]
        value = self.eval_interval
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"compare eval_interval={value!r} is not valid; use an int >= 1 or None")
        check_threshold_and_seed("compare ", self.threshold_percent, self.seed)
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise TypeError(f"compare recipe must be an amp8.Recipe or None, got {type(self.recipe).__name__}")
        check_device_and_levels("compare ", self.device, self.levels)
        if "O0" not in self.levels:
            raise ValueError(f"compare levels={self.levels} lacks 'O0'; every gap is measured against O0, so include it")

    def replace(self, **changes: Any) -> "UserCompareConfig":
        """A copy with ``changes`` applied and validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds the levels train from: ``seed, seed + 1, ...``, ``seeds`` of them."""
        return tuple(range(self.seed, self.seed + self.seeds))

    @property
    def has_validation(self) -> bool:
        """Whether the gaps are of a validation loss (``eval_data`` was given)."""
        return self.eval_data is not None

    def describe(self) -> str:
        """One line: model, steps, seeds when several, device and the recipe when given."""
        model = self.name or (type(self.model).__name__ if isinstance(self.model, nn.Module)
                              else describe_callable(self.model))
        seeds = f", seeds {self.seed}-{self.seed + self.seeds - 1}" if self.seeds > 1 else ""
        recipe = "" if self.recipe is None else f", {self.recipe.granularity.value} scaling"
        return f"{model}, {self.steps} steps{seeds}, {self.device}{recipe}"

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data, for JSON: the callables by name."""
        data = self.data
        size = len(data) if isinstance(data, collections.abc.Sized) else None
        eval_size = len(self.eval_data) if isinstance(self.eval_data, collections.abc.Sized) else None
        recipe = None if self.recipe is None else {
            key: getattr(value, "value", value) for key, value in dataclasses.asdict(self.recipe).items()
        }
        return {
            "model": self.name or describe_callable(self.model),
            "optimizer": "torch.optim.AdamW (torch's defaults)" if self.optimizer is None
            else describe_callable(self.optimizer),
            "loss": "model(**batch).loss or model(batch)" if self.loss is None else describe_callable(self.loss),
            "scheduler": None if self.scheduler is None else describe_callable(self.scheduler),
            "data": {"type": type(data).__name__, "batches": size},
            "eval_data": None if self.eval_data is None else {"type": type(self.eval_data).__name__,
                                                              "batches": eval_size},
            "steps": self.steps, "levels": list(self.levels), "seeds": self.seeds, "seed": self.seed,
            "eval_interval": self.eval_interval, "train_loss_window": self.train_loss_window,
            "device": self.device, "recipe": recipe, "threshold_percent": self.threshold_percent,
        }
