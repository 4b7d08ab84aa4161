import dataclasses

import pytest

import amp8
from amp8.config.levels import O0, O1, O2, O3, Precision, override, resolve_level


def test_levels_map_names_to_frozen_rows() -> None:
    assert list(amp8.LEVELS) == ["O0", "O1", "O2", "O3"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        O1.gemm = Precision.FP32  # type: ignore[misc]
    with pytest.raises(TypeError):
        amp8.LEVELS["O4"] = O1  # type: ignore[index]


@pytest.mark.parametrize(
    ("level", "weight", "master", "exp_avg", "exp_avg_sq"),
    [
        (O0, Precision.AS_IS, None, Precision.FP32, Precision.FP32),
        (O1, Precision.FP16, None, Precision.FP32, Precision.FP32),
        (O2, Precision.FP16, None, Precision.FP8, Precision.FP16),
        (O3, Precision.FP8, Precision.FP16, Precision.FP8, Precision.FP16),
    ],
)
def test_table_columns(level, weight, master, exp_avg, exp_avg_sq) -> None:
    assert (level.weight, level.master_weight, level.exp_avg, level.exp_avg_sq) == (
        weight, master, exp_avg, exp_avg_sq,
    )
    assert level.swaps_layers is (level is not O0)
    assert level.brief and level.description


def test_resolve_level() -> None:
    assert resolve_level("O2") is O2
    assert resolve_level(O3) is O3


@pytest.mark.parametrize("bad", ["O4", "o1", "fp8", 1, None])
def test_unknown_level_lists_levels(bad: object) -> None:
    with pytest.raises(ValueError, match="use one of 'O0', 'O1', 'O2', 'O3'"):
        resolve_level(bad)  # type: ignore[arg-type]


def test_digit_zero_gets_a_hint() -> None:
    with pytest.raises(ValueError, match="letter O, not the digit zero"):
        resolve_level("01")


def test_override_changes_a_column_and_marks_the_name() -> None:
    level = override("O2", exp_avg="fp32")
    assert level.exp_avg is Precision.FP32
    assert level.exp_avg_sq is Precision.FP16
    assert level.name == "O2+"


@pytest.mark.parametrize(("column", "value"), [("gemm", "fp32"), ("exp_avg", "fp16"), ("exp_avg_sq", "int8")])
def test_override_rejects_what_a_column_cannot_take(column: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"override\\({column}"):
        override("O2", **{column: value})


def test_columns_for_display() -> None:
    assert O3.columns()["master weights"] == "FP16 + scale, sharded"
    assert O1.columns()["weights"] == "FP16 + scale"
    assert O0.columns()["Adam m + v"] == "FP32 + FP32"


@pytest.mark.parametrize(
    ("column", "value", "allowed"),
    [
        ("gemm", "fp7", "'as is', 'fp32', 'fp16', 'fp8'"),
        ("weight", None, "'as is', 'fp32', 'fp16', 'fp8'"),
        ("master_weight", 3, "'fp8' or None"),
        ("shard_optimizer", 1, "True or False"),
        ("name", "", "non-empty str"),
    ],
)
def test_an_opt_level_with_a_bad_column_is_refused(column: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as error:
        dataclasses.replace(O2, **{column: value})
    assert f"OptLevel.{column}={value!r} is not valid" in str(error.value)
    assert allowed in str(error.value)


def test_an_opt_level_takes_precision_names() -> None:
    level = dataclasses.replace(O2, name="mine", exp_avg="fp32")
    assert level.exp_avg is Precision.FP32
