"""Each FP8 layer's GEMM operands in the precision report, read from its health buffer."""

from __future__ import annotations

import contextlib

import pytest
import torch
from rich.console import Console
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.quant import scaling
from amp8.tensor.weight_grad import WeightGrad


def _model(recipe: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=amp8.Recipe.preset(recipe))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    out.pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return out.detach()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_a_watched_step_gives_each_operands_sqnr_within_a_tenth_of_a_db(recipe: str) -> None:
    model, optimizer = _model(recipe)
    inputs: dict[str, torch.Tensor] = {}
    layer = model[2]
    layer.register_forward_pre_hook(lambda module, args: inputs.setdefault("x", args[0].detach()))
    assert all(row.operands is None for row in amp8.report(model, optimizer).rows), "nothing before a watch"
    x = torch.randn(32, 64) * torch.logspace(-2, 2, 64)
    with amp8.watch_operands(model) as watched:
        _step(model, optimizer, x)
    assert watched == [model[0], model[2]] and not layer.watch_health, "the layers watch as before"
    row = next(row for row in amp8.report(model, optimizer).rows if row.name == "2.weight")
    fprop_input = row.operands["fprop input"]
    direct = layer.quantizers.input.cast(inputs["x"]).dequantize()
    assert fprop_input["sqnr_db"] == pytest.approx(scaling.sqnr(inputs["x"], direct), abs=0.1)
    assert fprop_input["amax"] == pytest.approx(float(inputs["x"].abs().max()))
    assert set(row.operands) >= {"fprop input", "fprop weight", "dgrad grad output", "wgrad input"}


def test_watching_changes_no_result_bit_for_bit() -> None:
    x = torch.randn(16, 64)
    runs = []
    for watch in (False, True):
        model, optimizer = _model("rowwise")
        with amp8.watch_operands(model) if watch else contextlib.nullcontext():
            out = _step(model, optimizer, x)
        runs.append([out, *(p.detach().clone() for p in model.parameters())])
    for left, right in zip(*runs):
        assert torch.equal(left, right)


def test_the_report_prints_the_operands_of_the_watched_layers() -> None:
    model, optimizer = _model("tensorwise")
    with amp8.watch_operands(model):
        _step(model, optimizer, torch.randn(16, 64))
    console = Console(record=True, width=140, file=open("/dev/null", "w"))  # noqa: SIM115
    amp8.report(model, optimizer).print(console)
    text = console.export_text()
    assert "GEMM operands, last watched" in text
    assert sum(line.startswith(("0 ", "2 ")) for line in text.splitlines()) == 2, text
    assert isinstance(model[0], Fp8Linear)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fp8_weight_gradients_cast_is_watched_too(monkeypatch: pytest.MonkeyPatch, recipe: str) -> None:
    model, optimizer = _model(recipe)
    seen: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    original = WeightGrad.from_float.__func__  # type: ignore[attr-defined]

    def recording(cls, value, layout, dtype, compiled=False, slot=None):  # type: ignore[no-untyped-def]
        grad = original(cls, value, layout, dtype, compiled, slot)
        seen[tuple(value.shape)] = (value.detach().float().clone(), grad.dequantize())
        return grad

    monkeypatch.setattr(WeightGrad, "from_float", classmethod(recording))
    with amp8.watch_operands(model):
        out = model(torch.randn(32, 64))
        out.pow(2).mean().backward()
    value, stored = seen[tuple(model[2].weight.shape)]
    row = next(row for row in amp8.report(model, optimizer).rows if row.name == "2.weight")
    assert row.operands["weight gradient"]["sqnr_db"] == pytest.approx(scaling.sqnr(value, stored), abs=0.1)
    assert row.operands["weight gradient"]["amax"] == pytest.approx(float(value.abs().max()))
