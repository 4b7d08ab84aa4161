"""Checks of numbers read back from a checkpoint, before they reach a layer or optimizer.

A scale of 0, inf or NaN, or an amax history with a negative or non-finite entry, would
turn every later cast into zeros or NaN; ``load_state_dict`` refuses them with the key
that holds them instead.
"""

from __future__ import annotations

from typing import Callable

import torch


def check_loaded_scales(key: str, value: torch.Tensor, expected_shape: tuple[int, ...] | None = None) -> None:
    """Raise ``ValueError`` unless every element of the scales ``value`` loaded under
    ``key`` is finite and > 0 (and ``value`` has ``expected_shape``, when given).

    Raises:
        TypeError: ``value`` is not a floating-point tensor.
        ValueError: a wrong shape, or a scale that is not finite or not positive; the
            message names ``key``, the first bad element and how many there are.
    """
    _check_loaded(key, value, "scales", expected_shape, lambda v: torch.isfinite(v) & (v > 0), "finite and > 0")


def check_loaded_history(key: str, value: torch.Tensor, expected_shape: tuple[int, ...] | None = None) -> None:
    """Raise ``ValueError`` unless every element of the amax history ``value`` loaded
    under ``key`` is finite and >= 0 (and ``value`` has ``expected_shape``, when given).

    Raises:
        TypeError: ``value`` is not a floating-point tensor.
        ValueError: a wrong shape, or an entry that is not finite or negative; the
            message names ``key``, the first bad element and how many there are.
    """
    _check_loaded(
        key, value, "amax history", expected_shape, lambda v: torch.isfinite(v) & (v >= 0), "finite and >= 0"
    )


def _check_loaded(
    key: str,
    value: torch.Tensor,
    what: str,
    expected_shape: tuple[int, ...] | None,
    valid: Callable[[torch.Tensor], torch.Tensor],
    rule: str,
) -> None:
    """Raise unless ``value`` is a floating-point tensor of ``expected_shape`` whose
    elements all pass ``valid`` (``rule`` says so in words)."""
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"checkpoint entry {key!r} ({what}) must be a floating-point tensor, got {kind}")
    if expected_shape is not None and tuple(value.shape) != tuple(expected_shape):
        raise ValueError(
            f"checkpoint entry {key!r} ({what}) has shape {tuple(value.shape)}, expected "
            f"{tuple(expected_shape)}; was it saved from a model of another size or recipe?"
        )
    bad = ~valid(value.detach().float())
    count = int(bad.sum())
    if count:
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"checkpoint entry {key!r} ({what}) must be {rule} everywhere; {count} of "
            f"{value.numel()} elements are not, the first {float(value[index])} at index {index}. "
            "The checkpoint is damaged or was written by a run that had already diverged"
        )
