"""Checks of scales and amax histories read back from a checkpoint: which values they
refuse and what their messages say. That every load path runs them:
tests/nn/test_corrupt_checkpoints.py (layers), tests/optim/test_optim_checkpoint.py
(optimizer state)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from amp8.quant.checks import check_loaded_history, check_loaded_scales

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "value",
    [torch.tensor(2.0**126), torch.tensor([[0.5, 3.0], [1e-30, 448.0]]), torch.ones(4, 1)],
    ids=["scalar", "blocks", "rowwise"],
)
def test_good_scales_pass(value: torch.Tensor) -> None:
    check_loaded_scales("layer.weight_scale", value, tuple(value.shape))
    check_loaded_scales("layer.weight_scale", value)


@pytest.mark.parametrize(
    ("values", "first", "index", "count"),
    [
        ([0.0], "0.0", "(0,)", 1),
        ([1.0, -2.0], "-2.0", "(1,)", 1),
        ([1.0, NAN, INF], "nan", "(1,)", 2),
        ([-INF, 1.0], "-inf", "(0,)", 1),
        ([[0.5, 3.0], [0.0, INF]], "0.0", "(1, 0)", 2),  # block scales
    ],
)
def test_bad_scales_name_the_key_and_the_first_bad_element(
    values: list[float], first: str, index: str, count: int
) -> None:
    value = torch.tensor(values)
    with pytest.raises(ValueError) as error:
        check_loaded_scales("0.scale", value)
    message = str(error.value)
    assert "'0.scale' (scales) must be finite and > 0" in message
    assert f"{count} of {value.numel()} elements are not, the first {first} at index {index}" in message


@pytest.mark.parametrize("values", [[0.0, 0.0], [3.0, 0.0, 1e38]], ids=["zeros", "mixed"])
def test_good_histories_pass(values: list[float]) -> None:
    check_loaded_history("0.amax_history", torch.tensor(values))


@pytest.mark.parametrize(("values", "first"), [([1.0, -0.5], "-0.5"), ([NAN], "nan"), ([INF, 2.0], "inf")])
def test_bad_histories_name_the_key(values: list[float], first: str) -> None:
    with pytest.raises(ValueError, match=rf"'0.amax_history' \(amax history\) must be finite and >= 0 .* the first {first}"):
        check_loaded_history("0.amax_history", torch.tensor(values))


@pytest.mark.parametrize("check", [check_loaded_scales, check_loaded_history])
def test_wrong_shape_names_both_shapes(check: Callable[..., None]) -> None:
    with pytest.raises(ValueError, match=r"'k' .* has shape \(3, 16\), expected \(3, 4\)"):
        check("k", torch.ones(3, 16), (3, 4))


@pytest.mark.parametrize("check", [check_loaded_scales, check_loaded_history])
@pytest.mark.parametrize("value", [torch.ones(2, dtype=torch.int64), [1.0, 2.0]], ids=["int-tensor", "list"])
def test_non_float_values_are_a_type_error(check: Callable[..., None], value: object) -> None:
    with pytest.raises(TypeError, match="'k' .* must be a floating-point tensor"):
        check("k", value)
