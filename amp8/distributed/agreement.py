"""Do all ranks of a process group set up the same FP8 training?

Ranks that disagree on the opt level, the recipe or the model would otherwise train
apart without a word (O1 against O2, HYBRID against E4M3), die inside a collective
(another hidden size, delayed against current scaling) or hang until the process
group's timeout (an extra layer, O3 against O2). ``check_ranks_agree`` compares a short
description of each rank's setup with one ``all_gather_object`` before anything else
talks over the wire, and fails on every rank with the first difference. A rank whose own
checks failed sends its error instead, so the others stop with it rather than wait for it
in a later collective.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

import torch.distributed as dist
from torch import nn

from amp8.config.levels import OptLevel
from amp8.config.recipe import Recipe


def describe_setup(model: nn.Module, level: OptLevel, recipe: Recipe) -> list[tuple[str, str]]:
    """What must be the same on every rank, as ``(field, value)`` pairs in a fixed order:
    the opt level (its name and columns), every field of the recipe, the number of
    parameters and buffers, then each one's name, shape and dtype."""
    fields = [(f"opt level {column.name}", _show(getattr(level, column.name)))
              for column in dataclasses.fields(level) if column.name not in ("brief", "description")]
    fields += [(f"recipe.{field.name}", _show(getattr(recipe, field.name))) for field in dataclasses.fields(recipe)]
    parameters, buffers = list(model.named_parameters()), list(model.named_buffers())
    fields += [("number of parameters", str(len(parameters))), ("number of buffers", str(len(buffers)))]
    for kind, named in (("parameter", parameters), ("buffer", buffers)):
        fields += [(f"{kind} #{index}", _tensor(name, tensor)) for index, (name, tensor) in enumerate(named)]
    return fields


def check_ranks_agree(
    model: nn.Module,
    level: OptLevel | None,
    recipe: Recipe | None,
    group: dist.ProcessGroup | None = None,
    failure: Exception | None = None,
) -> None:
    """Raise on every rank of ``group`` (default: the world) unless all ranks passed their
    own checks (``failure`` is None) and the same opt level, recipe and model (parameter
    and buffer names, shapes and dtypes). Call it on every rank; it is one
    ``all_gather_object`` of a few bytes per parameter.

    Raises:
        the rank's own ``failure``, on a rank that has one;
        RuntimeError: on the other ranks, when a rank failed; it names that rank and its error;
        ValueError: the ranks differ; the message names the first field that differs,
            its value on rank 0 and on the first rank that differs from it.
    """
    mine: list[tuple[str, str]] | str
    if failure is None and level is not None and recipe is not None:
        mine = describe_setup(model, level, recipe)
    else:
        mine = f"{type(failure).__name__}: {failure}"
    gathered: list[list[tuple[str, str]] | str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if failure is not None:
        raise failure
    failed = next((index for index, other in enumerate(gathered) if isinstance(other, str)), None)
    if failed is not None:
        raise RuntimeError(
            f"amp8.initialize failed on rank {_global_rank(group, failed)} ({gathered[failed]}); "
            "this rank stops too, instead of waiting for it. Fix the call on that rank"
        )
    reference = gathered[0]
    for index, other in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, other)  # type: ignore[arg-type]
        if difference is not None:
            field, ours, theirs = difference
            rank, first = _global_rank(group, index), _global_rank(group, 0)
            raise ValueError(
                f"amp8.initialize: the ranks disagree on {field}: {ours} on rank {first}, "
                f"{theirs} on rank {rank}. Every rank must call amp8.initialize with the same "
                "opt_level, recipe and model; without that they would train apart, fail inside "
                "a collective or hang"
            )


def _global_rank(group: dist.ProcessGroup | None, index: int) -> int:
    return dist.get_global_rank(group, index) if group is not None else index


def _first_difference(
    reference: list[tuple[str, str]], other: list[tuple[str, str]]
) -> tuple[str, str, str] | None:
    """``(field, value in reference, value in other)`` of the first field that differs."""
    for (field, ours), (_, theirs) in zip(reference, other):
        if ours != theirs:
            return field, ours, theirs
    return None  # both lists hold the same fields: the counts come before the tensors


def _tensor(name: str, tensor: object) -> str:
    shape = tuple(getattr(tensor, "shape", ()))
    dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
    return f"{name} {shape} {dtype}"


def _show(value: object) -> str:
    if isinstance(value, Enum):
        value = value.value
    return repr(value)
