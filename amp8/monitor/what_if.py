"""What another recipe would give: the SQNR of each FP8 layer's casts under every recipe
amp8 has, from the live tensors of one step.

Inside ``with amp8.what_if(model) as found:``, each ``Fp8Linear``'s input (as its
forward gets it), weight and output gradient (as its backward gets it) are cast under
the layer's own casts (``"current"``, reading its scale buffers, writing none) and under
each preset (``WHAT_IF_RECIPES``), and only the SQNRs are kept. The casts run on
detached tensors without gradients and write no buffer, so the step trains as it
would without the block. ``found.advice()`` names the recipes that gain a lot on a few
layers, and says whether the controller's ladder would take those layers there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from amp8.config.recipe import GRANULARITY_LADDER, Granularity, Recipe
from amp8.monitor.console import default_console
from amp8.monitor.operand_health import GEMM_TENSORS, CastTensor
from amp8.monitor.report_fold import fold_names
from amp8.nn.cast_rule import CastRule, TensorRole
from amp8.nn.linear import Fp8Linear
from amp8.nn.quantizer import Quantizer
from amp8.quant.scaling import sqnr

WHAT_IF_RECIPES = ("tensorwise", "rowwise", "deepseek", "mxfp8", "nvfp4")
"""The presets every cast is tried under ("deepseek": 128-element tiles and 128 x 128
weight blocks)."""

CURRENT = "current"


def _sqnr_db(quantizer: Quantizer, x: torch.Tensor) -> float:
    """The SQNR of ``quantizer``'s cast of the 2-D ``x`` (its rows the tokens or output
    features, contracting its last dim as fprop and dgrad do); NaN where the cast does
    not take this shape (NVFP4 needs even sizes, say)."""
    try:
        return sqnr(x, quantizer.cast(x).dequantize())
    except ValueError:
        return math.nan


@dataclass
class WhatIf:
    """SQNRs found inside ``what_if``: ``layers[name][tensor][recipe]`` in dB, for each
    FP8 layer's "input", "weight" and "grad output" under "current" and each preset;
    ``granularities[name]``: the layer's GEMM granularity when it ran."""

    layers: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    granularities: dict[str, Granularity] = field(default_factory=dict)

    def worst(self, name: str, recipe: str) -> float:
        """The worst SQNR over a layer's tensors under ``recipe`` (NaN where none has one)."""
        values = [by_recipe[recipe] for by_recipe in self.layers[name].values() if not math.isnan(by_recipe[recipe])]
        return min(values) if values else math.nan

    def gains(self, recipe: str) -> dict[str, float]:
        """Per layer: ``recipe``'s worst SQNR over its tensors minus the current casts'."""
        return {name: self.worst(name, recipe) - self.worst(name, CURRENT) for name in self.layers}

    def standout_gains(self, recipe: str) -> dict[str, tuple[str, float, float]]:
        """Per layer, the tensor on which ``recipe`` gains the most beyond what it gains
        on that tensor of the median layer: ``(tensor, gain in dB, excess over the
        median layer's gain in dB)``. A recipe that gains alike everywhere (E4M3
        gradients over E5M2 ones, say) stands out nowhere."""
        found: dict[str, tuple[str, float, float]] = {}
        for tensor in (tensor.value for tensor in GEMM_TENSORS):
            gains = {name: tensors[tensor][recipe] - tensors[tensor][CURRENT]
                     for name, tensors in self.layers.items() if tensor in tensors}
            finite = [gain for gain in gains.values() if math.isfinite(gain)]
            if not finite:
                continue
            median = statistics.median(finite)
            for name, gain in gains.items():
                if math.isfinite(gain) and (name not in found or gain - median > found[name][2]):
                    found[name] = (tensor, gain, gain - median)
        return found

    def advice(self, min_gain_db: float = 3.0, max_share: float = 0.25) -> list[str]:
        """A line per preset that gains at least ``min_gain_db`` more than on the median
        layer (``standout_gains``) on some layers, at most ``max_share`` of them: the
        gain, the tensor, the layers (folded over blocks), and whether the controller's
        ladder would take them there (its next rung from their granularity)."""
        lines = []
        for recipe in WHAT_IF_RECIPES:
            chosen = {name: found for name, found in self.standout_gains(recipe).items() if found[2] >= min_gain_db}
            if not chosen or len(chosen) > max_share * len(self.layers):
                continue
            names = [entry.name for entry in fold_names(list(chosen))]
            tensors = sorted({tensor for tensor, _, _ in chosen.values()})
            granularity = Recipe.preset(recipe).granularity
            on_ladder = all(_next_rung(self.granularities[name]) is granularity for name in chosen)
            ladder = ("the controller's next rung for them" if on_ladder
                      else "not the controller's next rung: set them apart with Recipe.high_precision_layers "
                           "or a recipe of their own")
            lines.append(f"{recipe}: +{min(gain for _, gain, _ in chosen.values()):.1f} dB or more on the "
                         f"{'/'.join(tensors)} of {len(chosen)} layer{'s' if len(chosen) > 1 else ''}, "
                         f"{', '.join(names)} ({ladder})")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The SQNRs as plain data (NaN as None)."""
        return {name: {tensor: {recipe: None if math.isnan(value) else value for recipe, value in by_recipe.items()}
                       for tensor, by_recipe in tensors.items()} for name, tensors in self.layers.items()}

    def print(self, console: Any = None) -> None:
        """Print a table of the worst SQNR over each layer's tensors under each recipe
        (repeated blocks folded: the worst block), then the advice, to ``console`` (a
        ``rich.console.Console``; None: amp8's default console on stdout, as
        ``PrecisionReport.print`` does). Where no FP8 layer ran inside the block, one
        line says so and what to run."""
        from rich import box
        from rich.table import Table

        console = console or default_console()
        names = list(self.layers)
        if not names:
            console.print("what-if: no FP8 layer ran inside `with amp8.what_if(model) as found:`; run one forward "
                          "and backward of the amp8.initialize'd model there, then call found.print()",
                          highlight=False, markup=False)
            return
        table = Table(title="what-if: worst SQNR over each layer's input, weight and output gradient (dB)",
                      box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True,
                      title_justify="left")
        table.add_column("layer", no_wrap=True)
        for recipe in (CURRENT, *WHAT_IF_RECIPES):
            table.add_column(recipe, justify="right")
        for entry in fold_names(names):
            members = [names[position] for position in entry.members]
            cells = []
            for recipe in (CURRENT, *WHAT_IF_RECIPES):
                values = [self.worst(name, recipe) for name in members]
                finite = [value for value in values if not math.isnan(value)]
                cells.append(f"{min(finite):.1f}" if finite else "-")
            table.add_row(entry.name, *cells)
        console.print(table)
        for line in self.advice() or ["no other recipe stands out by 3 dB on a few layers"]:
            console.print(f"  {line}", highlight=False, markup=False)


def _next_rung(granularity: Granularity) -> Granularity | None:
    """The controller's next granularity from ``granularity`` (None at the top)."""
    index = GRANULARITY_LADDER.index(granularity) if granularity in GRANULARITY_LADDER else len(GRANULARITY_LADDER)
    return GRANULARITY_LADDER[index + 1] if index + 1 < len(GRANULARITY_LADDER) else None


def _casts(layer: Fp8Linear, role: TensorRole) -> dict[str, Quantizer]:
    """The layer's own cast of ``role`` and each preset's."""
    return {CURRENT: layer.quantizers.of(role),  # a cast that records and watches nothing
            **{name: Quantizer(CastRule.for_role(Recipe.preset(name), role)) for name in WHAT_IF_RECIPES}}


def _record(found: WhatIf, name: str, layer: Fp8Linear, tensor: CastTensor, x: torch.Tensor) -> None:
    """Record into ``found`` the SQNR of each cast of ``x``, ``layer``'s ``tensor`` (one
    of ``GEMM_TENSORS``)."""
    with torch.no_grad():
        rows = x.detach().reshape(-1, x.shape[-1])
        casts = _casts(layer, tensor.role)  # type: ignore[arg-type]
        found.layers.setdefault(name, {})[tensor.value] = {
            recipe: _sqnr_db(quantizer, rows) for recipe, quantizer in casts.items()
        }


def _hook(found: WhatIf, name: str, layer: Fp8Linear) -> list[Any]:
    """Hook ``layer`` to record its input and weight (forward) and its output gradient
    (backward) into ``found``; returns the hooks' handles."""

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        _record(found, name, layer, CastTensor.INPUT, args[0])
        weight = layer.read_weight()  # type: ignore[operator]
        _record(found, name, layer, CastTensor.WEIGHT, weight.t() if layer.weight_transposed else weight)

    def after(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: _record(found, name, layer, CastTensor.GRAD_OUTPUT, grad))

    return [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]


class WhatIfBlock:
    """What ``amp8.what_if(model)`` returns: a context manager that hooks each FP8 layer
    of ``model`` on entering, yields the ``WhatIf`` the hooks fill and removes them on
    leaving. It holds no results itself: ``found.print()`` and the rest are on the
    ``WhatIf`` that ``with ... as found`` gives, and calling them here says so."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []
        self._entered = False

    def __enter__(self) -> WhatIf:
        if self._entered:
            raise RuntimeError("this amp8.what_if(model) block was entered already; "
                               "call amp8.what_if(model) again for another step")
        self._entered = True
        found = WhatIf()
        for name, layer in self.model.named_modules():
            if not isinstance(layer, Fp8Linear):
                continue
            found.granularities[name] = layer.gemm_recipe.granularity
            self._handles += _hook(found, name, layer)
        return found

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __getattr__(self, name: str) -> Any:
        if name in _WHAT_IF_API:
            raise AttributeError(
                f"amp8.what_if(model) is a block, not its result, so it has no .{name}: write "
                f"`with amp8.what_if(model) as found:`, run one forward and backward inside, then use "
                f"found.{name}{'()' if callable(getattr(WhatIf, name, None)) else ''}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_WHAT_IF_API = frozenset({"print", "advice", "to_dict", "worst", "gains", "standout_gains", "layers", "granularities"})
"""The ``WhatIf`` names that ``WhatIfBlock`` points to when called on the block."""


def what_if(model: nn.Module) -> WhatIfBlock:
    """Find, over the step run inside ``with amp8.what_if(model) as found:``, the SQNR
    each FP8 layer's casts would get under each recipe (see the module docstring); the
    block yields the ``WhatIf`` it fills, whose ``print()``, ``advice()``, ``layers``
    and ``to_dict()`` give the results once the block has run."""
    return WhatIfBlock(model)
