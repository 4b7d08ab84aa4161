import pytest

from amp8 import AmaxAlgo, Fp8Format, Recipe, Scaling


def test_defaults() -> None:
    recipe = Recipe()
    assert recipe.fp8_format is Fp8Format.HYBRID
    assert recipe.scaling is Scaling.CURRENT
    assert recipe.amax_compute_algo is AmaxAlgo.MAX
    assert recipe.override_linear_precision == (False, False, False)


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
        ("amax_history_len", 0, "int >= 1"),
        ("amax_history_len", 2.5, "int >= 1"),
        ("margin", -1, "int >= 0"),
        ("power_of_2_scales", "yes", "True or False"),
        ("override_linear_precision", (True, False), "three bools"),
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
