"""Checkpoints across recipes: a layer's checkpoint records the recipe its scales and
GEMM precision were made under, so a model of another recipe converts the weight from
the scales' own layout and keeps its own GEMMs."""

from __future__ import annotations

import io
import itertools
import warnings

import pytest
import torch
from torch import nn

import amp8
from conftest import assert_bitwise_equal, mlp

RECIPES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe.preset("rowwise"),
    "block128": amp8.Recipe.preset("deepseek"),
    "block64": amp8.Recipe.preset("deepseek").replace(block_size=64),
    "mxfp8": amp8.Recipe.preset("mxfp8"),
    "nvfp4": amp8.Recipe.preset("nvfp4"),
}
PAIRS = [pair for pair in itertools.permutations(RECIPES, 2)]


def _model(level: str, recipe: str) -> nn.Module:
    return amp8.initialize(mlp(128, 256, 64), None, level, recipe=RECIPES[recipe])[0]


def _saved_and_loaded(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` in its compact form (the stored weights, their scales and
    recipe) through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    with amp8.compact_state_dict(model):
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_a_checkpoint_of_another_recipe_keeps_this_layers_gemms(level: str, source: str, target: str) -> None:
    """The checkpoint's GEMM precision belongs to its recipe: not taken, with a warning;
    the FP16 weights load exactly."""
    saved, model = _model(level, source), _model(level, target)
    expected = [layer.gemm_description for layer in (model[0], model[2])]
    with pytest.warns(UserWarning, match=r"0\.gemm_precision .* another recipe"):
        model.load_state_dict(_saved_and_loaded(saved))
    assert [layer.gemm_description for layer in (model[0], model[2])] == expected
    assert model[0].gemm_recipe == RECIPES[target].for_gemms(RECIPES[target].granularity, (False,) * 3)
    assert_bitwise_equal(model[0].read_weight(), saved[0].read_weight())
    model(torch.randn(4, 128)).sum().backward()


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_o3_checkpoints_load_across_scale_layouts(source: str, target: str) -> None:
    """FP8 weights saved with one recipe's scales (per tensor, row, 1 x 32, 16 x 16,
    64 x 64 or 128 x 128) are read with those scales and stored again with this one's."""
    saved, model = _model("O3", source), _model("O3", target)
    with pytest.warns(UserWarning, match=r"converted 0\.weight"):
        model.load_state_dict(_saved_and_loaded(saved))
    for index in (0, 2):
        data, scale = model[index].stored_weight.encode(saved[index].read_weight())
        assert_bitwise_equal(model[index].stored_weight.data, data)
        assert_bitwise_equal(model[index].weight_scale, scale.to(model[index].weight_scale.dtype))


def test_a_checkpoint_of_the_same_recipe_loads_without_a_warning() -> None:
    saved, model = _model("O3", "mxfp8"), _model("O3", "mxfp8")
    with torch.no_grad():
        saved[0].write_weight(saved[0].read_weight() * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(_saved_and_loaded(saved))
    assert_bitwise_equal(model[0].stored_weight.data, saved[0].stored_weight.data)


def test_a_corrupt_recipe_record_is_refused() -> None:
    with amp8.compact_state_dict(model := _model("O1", "tensorwise")):
        state = model.state_dict()
    state._metadata["0"]["amp8_recipe"] = {"granularity": "tensorwise"}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="amp8_recipe.*not an amp8 recipe record"):
        _model("O1", "tensorwise").load_state_dict(state)
