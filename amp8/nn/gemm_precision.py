"""How an ``Fp8Linear``'s GEMMs run now, and how its ``gemm_precision`` buffer records it.

``amp8.Controller`` moves a layer's GEMMs (``set_gemm_precision``): to finer scales or to
high precision, each of fprop, dgrad and wgrad on its own, and wgrad's outlier tokens
alone to high precision. The layer runs them under a GEMM recipe (``Recipe.for_gemms``)
and records that choice in its ``gemm_precision`` buffer as four integers: the index of
the granularity in ``GRANULARITY_LADDER``, then 1 for each of fprop, dgrad and wgrad that
runs in high precision, wgrad's entry ``OUTLIER_SPLIT`` where only its outlier tokens do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp8.config.gemms import Gemm
from amp8.config.recipe import GRANULARITY_LADDER, Granularity, Recipe

OUTLIER_SPLIT = 2
"""wgrad's entry in ``gemm_precision`` where only its outlier tokens run in high precision."""


class GemmPrecisionChoice(nn.Module):
    """The part of an ``Fp8Linear`` that says how its GEMMs run now: ``gemm_recipe``, the
    layer's ``recipe`` as ``set_gemm_precision`` last moved it, kept in the
    ``gemm_precision`` buffer (see the module docstring); ``gemm_moves`` lists the
    changes ``amp8.Controller`` made.

    The layer calls ``_init_gemm_precision`` from ``__init__`` and
    ``_record_gemm_precision`` where it builds its casts, and implements
    ``_gemms_changed`` (build the casts again), which ``set_gemm_precision`` calls.
    """

    recipe: Recipe
    gemm_recipe: Recipe
    gemm_precision: torch.Tensor

    def _init_gemm_precision(self, recipe: Recipe, device: torch.device) -> None:
        """Run the GEMMs as ``recipe`` says, with the ``gemm_precision`` buffer on
        ``device`` (written by ``_record_gemm_precision``)."""
        self.register_buffer("gemm_precision", torch.zeros(4, dtype=torch.int64, device=device))
        self.gemm_moves: list[Any] = []  # the ``amp8.monitor.controller.Move``s of this layer
        self.gemm_recipe = recipe

    def _record_gemm_precision(self) -> None:
        """Write ``gemm_recipe`` into the ``gemm_precision`` buffer (``to_empty`` leaves
        buffers uninitialized)."""
        with torch.no_grad():
            self.gemm_precision.copy_(torch.tensor(encode_gemm_precision(self.gemm_recipe)))

    def _gemms_changed(self) -> None:
        """Build again what serves the GEMMs (the layer's casts) for ``gemm_recipe``."""
        raise NotImplementedError

    def set_gemm_precision(
        self, granularity: Granularity | str, high_precision: tuple[bool, bool, bool], outlier_split: bool = False
    ) -> None:
        """Run the GEMMs from now on at ``granularity``, with each of (fprop, dgrad,
        wgrad) in high precision where ``high_precision`` says True, and wgrad's outlier
        tokens in high precision where ``outlier_split`` (``Recipe.wgrad_outlier_split``).
        The weight, its gradient and their scales stay as the recipe stores them; only
        the casts that feed the GEMMs change. ``amp8.Controller`` calls this; it is kept
        in ``state_dict`` (``gemm_precision``)."""
        self.gemm_recipe = self.recipe.for_gemms(Granularity(granularity), tuple(high_precision), outlier_split)
        self._gemms_changed()

    @property
    def gemm_granularity(self) -> Granularity:
        """The granularity of the GEMMs' FP8 scales now (see ``set_gemm_precision``)."""
        return self.gemm_recipe.granularity

    @property
    def high_precision_gemms(self) -> tuple[bool, bool, bool]:
        """Which of (fprop, dgrad, wgrad) run in high precision now."""
        return self.gemm_recipe.override_linear_precision  # type: ignore[return-value]

    @property
    def splits_wgrad_outliers(self) -> bool:
        """Whether wgrad's outlier tokens run in high precision and the rest in FP8 now
        (not where the whole of wgrad is high)."""
        return splits_wgrad_outliers(self.gemm_recipe)

    @property
    def gemm_description(self) -> str:
        """The GEMMs' precision in words: the granularity of their FP8 scales, then the
        GEMMs in high precision, e.g. "block, wgrad high" or "block, wgrad outliers
        high"."""
        high = [gemm.name.lower() for gemm, flag in zip(Gemm, self.high_precision_gemms) if flag]
        if self.splits_wgrad_outliers:
            high.append("wgrad outliers")
        text = self.gemm_granularity.value
        return f"{text}, {'+'.join(high)} high" if high else text


def splits_wgrad_outliers(gemm_recipe: Recipe) -> bool:
    """Whether wgrad's outlier tokens run in high precision and the rest in FP8 under
    ``gemm_recipe`` (not where the whole of wgrad is high)."""
    return gemm_recipe.wgrad_outlier_split and not gemm_recipe.override_linear_precision[-1]


def encode_gemm_precision(gemm_recipe: Recipe) -> list[int]:
    """The four integers of the ``gemm_precision`` buffer for ``gemm_recipe``."""
    high = [int(flag) for flag in gemm_recipe.override_linear_precision]
    if splits_wgrad_outliers(gemm_recipe):
        high[-1] = OUTLIER_SPLIT
    return [GRANULARITY_LADDER.index(gemm_recipe.granularity), *high]


def decode_gemm_precision(key: str, saved: torch.Tensor) -> tuple[Granularity, tuple[bool, bool, bool], bool]:
    """The choice a ``gemm_precision`` tensor records: ``(granularity, high_precision,
    outlier_split)``, the arguments of ``Recipe.for_gemms``.

    Raises:
        ValueError: ``saved`` is not four integers (a granularity index, then three 0/1
            flags, wgrad's also ``OUTLIER_SPLIT``); the message names ``key``, the
            checkpoint entry it came from.
    """
    values = saved.tolist() if saved.shape == (4,) and not saved.is_floating_point() else None
    if values is None or not 0 <= values[0] < len(GRANULARITY_LADDER) or any(
        v not in (0, 1) for v in values[1:3]
    ) or values[3] not in (0, 1, OUTLIER_SPLIT):
        raise ValueError(
            f"checkpoint entry {key} = {saved.tolist()} is not a GEMM precision: expected four integers, a "
            f"granularity index below {len(GRANULARITY_LADDER)}, two 0/1 flags and a wgrad entry of 0, 1 or "
            f"{OUTLIER_SPLIT}; the checkpoint is corrupt or not from amp8"
        )
    high = (bool(values[1]), bool(values[2]), values[3] == 1)
    return GRANULARITY_LADDER[values[0]], high, values[3] == OUTLIER_SPLIT
