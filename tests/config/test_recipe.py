import pytest
import torch

from amp8 import Recipe
from amp8.config import AmaxAlgo, Fp8Format, Scaling
from amp8.config.formats import forward_dtype, gradient_dtype, max_margin, max_value


def test_defaults() -> None:
    recipe = Recipe()
    assert recipe.fp8_format is Fp8Format.HYBRID
    assert recipe.scaling is Scaling.CURRENT
    assert recipe.amax_compute_algo is AmaxAlgo.MAX
    assert recipe.override_linear_precision == (False, False, False)
    assert (recipe.weight_grad_format, recipe.weight_grad_scaling) == ("E4M3", "weight")


def test_strings_become_enums() -> None:
    recipe = Recipe(fp8_format="E4M3", scaling="delayed", amax_compute_algo="most_recent")
    assert (recipe.fp8_format, recipe.scaling, recipe.amax_compute_algo) == (
        Fp8Format.E4M3, Scaling.DELAYED, AmaxAlgo.MOST_RECENT,
    )


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("fp8_format", "E5M2", "'HYBRID', 'E4M3'"),
        ("scaling", "just_in_time", "'current', 'delayed', 'none'"),
        ("amax_compute_algo", "mean", "'max', 'most_recent'"),
        ("fp8_format", None, "'HYBRID', 'E4M3'"),
        ("granularity", "columnwise", "'tensorwise', 'rowwise', 'block'"),
        ("amax_history_len", 0, "int in [1, 1024]"),
        ("amax_history_len", 2.5, "int in [1, 1024]"),
        ("amax_history_len", 1025, "int in [1, 1024]"),
        ("amax_history_len", True, "int in [1, 1024]"),
        ("margin", -1, "int in [0, 14]"),
        ("margin", 15, "int in [0, 14]"),
        ("margin", 19, "int in [0, 14]"),
        ("margin", 1000, "int in [0, 14]"),
        ("margin", 1.0, "int in [0, 14]"),
        ("power_of_2_scales", "yes", "True or False"),
        ("power_of_2_scales", 1, "True or False"),
        ("override_linear_precision", (True, False), "three bools"),
        ("override_linear_precision", "fff", "three bools"),
        ("block_size", 0, "int in [16, 1024] that is a multiple of 16"),
        ("block_size", 24, "int in [16, 1024] that is a multiple of 16"),
        ("block_size", 2048, "int in [16, 1024] that is a multiple of 16"),
        ("block_size", 128.0, "int in [16, 1024] that is a multiple of 16"),
        ("weight_grad_format", "E3M4", "'gradient', 'E4M3', 'E5M2'"),
        ("weight_grad_scaling", "block", "'weight', 'rowwise'"),
    ],
)
def test_invalid_field_names_field_and_allowed_values(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        Recipe(**{field: value})
    assert f"Recipe.{field}=" in str(error.value)
    assert allowed in str(error.value)


def test_replace_validates_again() -> None:
    recipe = Recipe().replace(margin=2)
    assert recipe.margin == 2
    with pytest.raises(ValueError, match="Recipe.margin"):
        recipe.replace(margin=-3)


@pytest.mark.parametrize(("scaling", "expected"), [("current", 1), ("delayed", 7)])
def test_history_len_only_matters_when_delayed(scaling: str, expected: int) -> None:
    assert Recipe(scaling=scaling, amax_history_len=7).history_len == expected


@pytest.mark.parametrize("fp8_format", list(Fp8Format))
def test_margin_bound_comes_from_the_formats_normal_range(fp8_format: Fp8Format) -> None:
    """The largest margin maps an amax onto a normal number of every dtype the format
    uses; one more takes it below E4M3's normal range."""
    bound = max_margin(fp8_format)
    dtypes = {forward_dtype(fp8_format), gradient_dtype(fp8_format)}
    assert all(max_value(d) / 2**bound >= torch.finfo(d).tiny for d in dtypes)
    assert any(max_value(d) / 2 ** (bound + 1) < torch.finfo(d).tiny for d in dtypes)
    assert Recipe(fp8_format=fp8_format, margin=bound).margin == bound


@pytest.mark.parametrize("field", ["amax_history_len", "block_size"])
def test_largest_allowed_values_are_accepted(field: str) -> None:
    assert getattr(Recipe(**{field: 1024}), field) == 1024


def test_replace_names_the_fields_when_given_an_unknown_one() -> None:
    with pytest.raises(TypeError, match=r"\['margn'\]; the fields are fp8_format, scaling"):
        Recipe().replace(margn=2)


@pytest.mark.parametrize(
    ("recipe", "tile"),
    [
        (Recipe(), None),
        (Recipe(weight_grad_scaling="rowwise"), (1, 64)),
        (Recipe(granularity="rowwise"), (1, 64)),
        (Recipe(granularity="block", block_size=16), (16, 16)),
        (Recipe(granularity="block", block_size=16, weight_grad_scaling="rowwise"), (1, 64)),
    ],
)
def test_weight_grad_tile_follows_its_own_scaling(recipe: Recipe, tile: tuple[int, int] | None) -> None:
    assert recipe.weight_grad_tile((32, 64)) == tile
