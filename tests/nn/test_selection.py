"""Speed rules: which eligible layers run in FP8."""

from __future__ import annotations

import pytest
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.nn.selection import DEFAULT_RULES, SpeedRule, resolve_selection

RULE = SpeedRule(min_features=64, min_weight_elements=64 * 128, source="test")


@pytest.mark.parametrize(
    ("in_features", "out_features", "selected"),
    [(64, 128, True), (128, 64, True), (48, 4096, False), (64, 64, False), (256, 256, True)],
)
def test_rule_selects_by_smaller_dim_and_weight_size(in_features: int, out_features: int, selected: bool) -> None:
    assert RULE.selects(in_features, out_features) is selected
    reason = RULE.reason(nn.Linear(in_features, out_features))
    assert (reason is None) is selected
    if not selected:
        assert f"in_features={in_features}" in reason and "speed rule" in reason


def _rows(speedups: dict[tuple[int, int], float]) -> list[dict[str, float]]:
    return [{"in_features": i, "out_features": o, "speedup": s} for (i, o), s in speedups.items()]


def test_fit_keeps_every_slower_shape_out_and_selects_the_rest() -> None:
    speedups = {
        (1024, 1024): 0.8, (1024, 4096): 0.95, (4096, 1024): 1.1, (2048, 2048): 1.05,
        (4096, 4096): 1.4, (8192, 8192): 1.7, (1024, 16384): 1.2,
    }
    rule = SpeedRule.fit(_rows(speedups), source="synthetic")
    for (i, o), speedup in speedups.items():
        if rule.selects(i, o):
            assert speedup >= 1.0, f"the fitted rule {rule} selects ({i}, {o}), measured {speedup}x"
    # (1024, 4096) at 0.95x forces either in*out > 4096*1024 or min(in, out) > 1024; each
    # selects three faster shapes, and the fit keeps the least strict thresholds.
    assert {shape for shape in speedups if rule.selects(*shape)} == {(1024, 16384), (4096, 4096), (8192, 8192)}
    assert (rule.min_features, rule.min_weight_elements) == (0, 4096 * 4096)


def test_fit_selects_nothing_when_fp8_never_wins() -> None:
    rule = SpeedRule.fit(_rows({(256, 256): 0.5, (4096, 4096): 0.9}), source="synthetic")
    assert not rule.selects(256, 256) and not rule.selects(4096, 4096)


def test_fit_selects_everything_when_fp8_always_wins() -> None:
    rule = SpeedRule.fit(_rows({(256, 256): 1.2, (4096, 4096): 1.9}), source="synthetic")
    assert (rule.min_features, rule.min_weight_elements) == (0, 0)


def test_rule_round_trips_through_json(tmp_path) -> None:
    assert SpeedRule.from_json(RULE.to_json()) == RULE
    path = tmp_path / "sweep.json"
    path.write_text('{"device": "GPU", "speed_rule": ' + RULE.to_json() + "}")
    assert SpeedRule.from_json(path) == RULE


@pytest.mark.parametrize("field", ["min_features", "min_weight_elements"])
@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_thresholds_are_refused(field: str, value: object) -> None:
    kwargs = {"min_features": 0, "min_weight_elements": 0, field: value}
    with pytest.raises(ValueError, match=f"SpeedRule.{field}"):
        SpeedRule(source="test", **kwargs)  # type: ignore[arg-type]


def test_auto_selects_every_layer_on_the_cpu_and_uses_the_cuda_rule_there() -> None:
    assert resolve_selection("auto", "cpu") is None
    cuda_rule = resolve_selection("auto", "cuda")
    assert cuda_rule is DEFAULT_RULES["cuda"]
    assert not cuda_rule.selects(256, 1024), "small layers are slower in FP8 on GPUs"
    assert cuda_rule.selects(8192, 8192)
    assert resolve_selection("all", "cuda") is None


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_initialize_applies_a_speed_rule_and_the_report_says_why(level: str) -> None:
    model, _ = amp8.initialize(_model(), None, level, layer_selection=RULE, recipe=amp8.Recipe())
    assert [type(model[i]) for i in (0, 2, 4)] == [nn.Linear, Fp8Linear, Fp8Linear]
    rows = {row.name: row for row in amp8.report(model).rows}
    assert not rows["0.weight"].fp8
    assert rows["0.weight"].note == "not selected for FP8 (module_filter or layer_selection)"


def test_auto_on_the_cpu_swaps_every_eligible_layer() -> None:
    model, _ = amp8.initialize(_model(), None, "O1", recipe=amp8.Recipe())
    assert all(isinstance(model[i], Fp8Linear) for i in (0, 2, 4))


def test_unknown_selection_is_refused_before_the_model_changes() -> None:
    model = _model()
    with pytest.raises(ValueError, match="layer_selection='fast' is not valid; use 'auto'"):
        amp8.initialize(model, None, "O1", layer_selection="fast", recipe=amp8.Recipe())
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 4))


def test_a_rule_without_a_str_source_is_refused() -> None:
    with pytest.raises(ValueError, match="SpeedRule.source=None is not valid; use a str"):
        SpeedRule(0, 0, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "measurement",
    [
        {"in_features": 64, "speedup": 1.0},
        {"in_features": 64, "out_features": 64, "speedup": "fast"},
        {"in_features": -64, "out_features": 64, "speedup": 1.0},
        {"in_features": 64.5, "out_features": 64, "speedup": 1.0},
        {"in_features": 64, "out_features": 64, "speedup": float("nan")},
        {"in_features": 64, "out_features": 64, "speedup": 0.0},
    ],
    ids=["missing", "not-a-number", "negative", "not-an-int", "nan", "zero"],
)
def test_fit_refuses_a_bad_measurement(measurement: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="SpeedRule.fit measurement .* is not valid"):
        SpeedRule.fit([measurement], source="test")  # type: ignore[list-item]


@pytest.mark.parametrize("text", ['{"min_features": 1}', '{"speed_rule": [1, 2]}', '{"speed_rule": {"source": "x"}}'])
def test_from_json_without_a_rule_says_what_it_needs(text: str) -> None:
    with pytest.raises(ValueError, match="holds no speed rule; it needs an object with min_features"):
        SpeedRule.from_json(text)
