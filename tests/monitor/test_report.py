import json

import pytest
import torch
from rich.console import Console
from torch import nn

import amp8
from amp8.config.formats import E4M3, max_value


def _model() -> nn.Module:
    # (B, T, C) model: two FP8-eligible layers and a head FP8 cannot run (10 outputs).
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10))


def _trained(level: str = "O1") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=amp8.Recipe())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6, 32)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def test_rows_show_what_is_stored() -> None:
    model, optimizer = _trained()
    rows = {row.name: row for row in amp8.report(model, optimizer).rows}
    fp8_weight = rows["0.weight"]
    assert (fp8_weight.weight, fp8_weight.grad, fp8_weight.master) == ("float16", "float8_e4m3fn", None)
    assert (fp8_weight.exp_avg, fp8_weight.exp_avg_sq) == ("float32", "float32")
    assert fp8_weight.fp8 and fp8_weight.layer == "Fp8Linear" and fp8_weight.note is None
    assert rows["0.bias"].weight == "float32" and not rows["0.bias"].fp8
    assert rows["4.weight"].note == "out_features=10 is not a multiple of 16"
    assert rows["3.weight"].layer == "LayerNorm"
    # 2 (FP16 weight) + 1 (FP8 grad) + 8 (FP32 m, v), plus the scales and the step counters.
    numel = fp8_weight.numel
    assert fp8_weight.bytes == numel * 11 + 4 + 4 + 4
    report = amp8.report(model, optimizer)
    assert 11.0 < report.fp8_bytes_per_param < 11.01
    assert report.skipped_steps == 0


def test_report_reads_tensors_not_the_table() -> None:
    model, optimizer = _trained()
    model(torch.randn(4, 32)).sum().backward()
    row = amp8.report(model, optimizer).rows[0]
    # FP16 weight, FP8 gradient, FP32 m and v: 2 + 1 + 8 bytes, plus 3 scales.
    assert row.grad == "float8_e4m3fn" and row.bytes == row.numel * 11 + 4 + 4 + 4
    model[0].weight_grad = None
    row = amp8.report(model, optimizer).rows[0]
    assert row.grad is None, "a cleared gradient must show as None"
    # A cleared FP8 gradient frees its bytes, as param.grad = None does.
    assert row.bytes == row.numel * 10 + 4 + 4


def test_o0_report_is_plain_fp32() -> None:
    model, optimizer = _trained("O0")
    report = amp8.report(model, optimizer)
    assert report.fp8_share == 0
    assert all(row.weight == "float32" and row.scale is None for row in report.rows)
    assert report.skipped_steps is None
    assert report.bytes_per_param == pytest.approx(16, abs=0.2)


def test_underflow_and_saturation_are_counted() -> None:
    model, _ = amp8.initialize(_model(), recipe=amp8.Recipe(scaling="delayed"))
    layer = model[0]
    weight = torch.full((64, 32), 1.0)
    weight[0, :4] = 1e-9  # vanishes in E4M3 at a scale near 448 / 1
    layer.write_weight(weight)
    layer.amax_history.zero_()
    layer.amax_history[1, 0] = 0.5  # delayed scale made for amax 0.5: every 1.0 saturates
    row = amp8.report(model).rows[0]
    assert row.scale == pytest.approx(max_value(E4M3) / 0.5)
    assert row.underflow == pytest.approx(4 / weight.numel())
    assert row.saturated == pytest.approx((weight.numel() - 4) / weight.numel())


def test_json_and_print() -> None:
    model, optimizer = _trained()
    report = amp8.report(model, optimizer)
    data = json.loads(report.to_json())
    assert data["rows"][0]["grad"] == "float8_e4m3fn"
    assert data["bytes_per_param"] == pytest.approx(report.bytes_per_param)
    console = Console(record=True, width=200)
    report.print(console)
    text = console.export_text()
    assert "0.weight" in text and "e4m3" in text
    assert "[1] 4.weight: out_features=10 is not a multiple of 16" in text
    assert " ".join(report.summary().split()) in " ".join(text.split()), "the summary line is missing"
    assert "master" not in text.split("\n")[2], "an empty master column is hidden before O3"


def test_o3_report_measures_the_master_weights_cast_to_fp8() -> None:
    model, optimizer = _trained("O3")
    row = amp8.report(model, optimizer).rows[0]
    assert (row.weight, row.master, row.exp_avg, row.exp_avg_sq) == (
        "float8_e4m3fn", "float16", "float8_e4m3fn", "float16",
    )
    master = optimizer.master_weight(model[0].weight)
    assert row.amax == pytest.approx(float(master.abs().max()))
    tiny = master.abs() * row.scale < 2.0**-10  # below half the smallest E4M3 subnormal
    assert row.underflow == pytest.approx(float((tiny & (master != 0)).sum()) / master.numel(), abs=1e-3)


def test_highlights_name_hot_spots_and_the_largest_tensors() -> None:
    model, _ = amp8.initialize(_model(), recipe=amp8.Recipe(scaling="delayed"))
    weight = torch.full((64, 32), 1.0)
    weight[0, :4] = 1e-9
    model[0].write_weight(weight)
    model[0].amax_history.zero_()
    model[0].amax_history[1, 0] = 0.5
    lines = amp8.report(model).highlights(top=2)
    assert lines[0] == (
        "FP8: 89.3% of parameters in 2 FP8 layers; high precision: 4.weight "
        "(out_features=10 is not a multiple of 16)"
    )
    assert lines[1] == "underflow hot spots: 0.weight 0.2%"
    assert lines[2] == "saturation hot spots: 0.weight 1e+02%"
    # FP16 weights (4 KiB): no gradient yet.
    assert lines[3] == "largest: 0.weight 4.0 KiB (40%), 2.weight 4.0 KiB (40%)"


def test_highlights_at_o0_and_without_false_saturation() -> None:
    line = amp8.report(_model()).highlights()[0]
    assert line.startswith("FP8: none; 3 kept in high precision: 0.weight (no FP8 layer in the model: O0"), line
    model, optimizer = _trained()  # current scaling: the amax maps onto the max, no clipping
    assert "saturation: none" in amp8.report(model, optimizer).highlights()


def test_tied_weight_row_says_why_it_stays_high_precision() -> None:
    model = nn.Sequential(nn.Embedding(32, 32), nn.Linear(32, 32, bias=False))
    model[1].weight = model[0].weight
    with pytest.warns(UserWarning, match="runs no layer in FP8"):
        model, _ = amp8.initialize(model, recipe=amp8.Recipe())
    (row,) = amp8.report(model).rows
    assert row.layer == "Embedding" and row.note == "weight is shared (0.weight, 1.weight)"


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * super().forward(x)


def _kept_kinds() -> nn.Module:
    """One GEMM layer of each kind amp8 keeps, beside one FP8 layer."""
    from transformers.pytorch_utils import Conv1D

    return nn.ModuleDict({
        "fp8": nn.Linear(32, 32),
        "subclass": _Scaled(32, 32),
        "conv_small": Conv1D(10, 32),  # out_features 10
        "attn": nn.MultiheadAttention(32, 2),
        "excluded": nn.Linear(32, 32),
    })


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_every_gemm_layer_kept_high_has_a_reason(level: str) -> None:
    model = _kept_kinds()
    with pytest.warns(UserWarning, match="in high precision"):
        model, _ = amp8.initialize(model, opt_level=level, recipe=amp8.Recipe(), module_filter=lambda m, fqn: fqn != "excluded")
    notes = {row.name: row.note for row in amp8.report(model).rows if row.name.endswith("weight")}
    assert notes["fp8.weight"] is None
    assert notes["subclass.weight"].startswith("_Scaled (an nn.Linear subclass) overrides forward")
    assert notes["conv_small.weight"] == "out_features=10 is not a multiple of 16"
    assert "F.multi_head_attention_forward" in notes["attn.out_proj.weight"]
    assert notes["excluded.weight"] == "not selected for FP8 (module_filter or layer_selection)"


def test_highlights_name_why_when_every_layer_is_kept() -> None:
    from transformers.pytorch_utils import Conv1D

    model = nn.Sequential(Conv1D(10, 32), nn.GELU(), nn.Linear(10, 32), _Scaled(32, 32))
    with pytest.warns(UserWarning, match="runs no layer in FP8"):
        model, _ = amp8.initialize(model, recipe=amp8.Recipe())
    line = amp8.report(model).highlights()[0]
    assert line.startswith("FP8: none; 3 kept in high precision: 0.weight (out_features=10 is not a multiple of 16)"), line
    assert "3.weight (_Scaled (an nn.Linear subclass) overrides forward" in line


def test_from_dict_round_trips() -> None:
    report = amp8.report(*_trained())
    again = amp8.monitor.PrecisionReport.from_dict(json.loads(report.to_json()))
    assert again.to_dict() == report.to_dict()


@pytest.mark.parametrize(("model", "optimizer", "message"), [
    ("model", None, r"amp8.report takes the model \(a torch.nn.Module\) first, got str"),
    (nn.Linear(16, 16), nn.Linear(16, 16), "amp8.report takes the optimizer .* got Linear"),
])
def test_report_refuses_wrong_types(model: object, optimizer: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        amp8.report(model, optimizer)  # type: ignore[arg-type]


@pytest.mark.parametrize("top", [0, -1, 2.5, True])
def test_highlights_refuses_a_bad_count(top: object) -> None:
    with pytest.raises(ValueError, match="use an int >= 1"):
        amp8.report(_model()).highlights(top)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [[], {"runs": []}, {"rows": "0.weight"}])
def test_from_dict_refuses_what_to_dict_does_not_write(data: object) -> None:
    with pytest.raises(ValueError, match="needs a dict with a list of 'rows'"):
        amp8.monitor.PrecisionReport.from_dict(data)  # type: ignore[arg-type]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 64)


@pytest.mark.parametrize("width", [80, 160])
def test_long_parameter_names_fold_instead_of_being_cut(width: int) -> None:
    model = nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"self_attn": _Attention()})])})})
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O3", recipe=amp8.Recipe())  # every column
    console = Console(record=True, width=width)
    amp8.report(model, optimizer).print(console)
    text = console.export_text()
    assert "…" not in text, text
    name = "model.layers.0.self_attn.q_proj.weight"
    first_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 2)
    assert name in first_column, f"{name} is not whole in\n{text}"


@pytest.mark.parametrize("activations", ["high", "fp8"])
def test_activation_bytes_per_token_sit_beside_bytes_per_param(activations: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1",
                                       recipe=amp8.Recipe(activations=activations))
    x = torch.randn(32, 64, requires_grad=True)
    with amp8.count_saved_bytes(model) as saved:
        loss = model(x).square().mean()
    loss.backward()
    measured = saved.per_token(x.shape[0])
    report = amp8.report(model, optimizer, activation_bytes_per_token=measured)
    assert f"{measured:,.0f} activation bytes/token" in report.summary()
    again = amp8.monitor.PrecisionReport.from_dict(json.loads(report.to_json()))
    assert again.activation_bytes_per_token == measured
