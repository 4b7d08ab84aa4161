"""What another recipe would give each FP8 layer's casts (amp8.what_if)."""

from __future__ import annotations

import math

import pytest
import torch
from rich.console import Console
from torch import nn

import amp8
from amp8.monitor.what_if import CURRENT, WHAT_IF_RECIPES
from amp8.quant.scaling import sqnr


def _model(depth: int = 8, recipe: amp8.Recipe | None = None) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    model, _ = amp8.initialize(nn.Sequential(*layers), None, "O1", recipe=recipe or amp8.Recipe(), layer_selection="all")
    return model


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    out.pow(2).mean().backward()
    grads = [p.grad.dequantize() if hasattr(p.grad, "dequantize") else p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


def test_the_step_trains_bit_for_bit_as_without_it() -> None:
    x = torch.randn(32, 64)
    plain = _step(_model(), x)
    model = _model()
    with amp8.what_if(model) as found:
        watched = _step(model, x)
    assert len(found.layers) == 8 and set(found.layers["0"]) == {"input", "weight", "grad output"}
    for left, right in zip(plain, watched):
        assert torch.equal(left, right)
    found.layers.clear()
    _step(model, x)
    assert found.layers == {}, "the hooks are gone: a step after the block records nothing"


def test_each_sqnr_is_a_direct_quantize_dequantize_of_the_live_tensor() -> None:
    model = _model()
    inputs = {}
    model[2].register_forward_pre_hook(lambda module, args: inputs.setdefault("x", args[0].detach()))
    with amp8.what_if(model) as found:
        _step(model, torch.randn(32, 64))
    x, layer = inputs["x"], model[2]
    assert found.layers["2"]["input"][CURRENT] == pytest.approx(sqnr(x, layer.quantizers.input.cast(x).dequantize()), abs=0.1)
    rowwise = amp8.Recipe.preset("rowwise")
    cast = amp8.nn.Quantizer(amp8.nn.CastRule.for_role(rowwise, amp8.nn.TensorRole.INPUT)).cast(x)
    assert found.layers["2"]["input"]["rowwise"] == pytest.approx(sqnr(x, cast.dequantize()), abs=0.1)
    assert set(found.layers["2"]["weight"]) == {CURRENT, *WHAT_IF_RECIPES}


def test_advice_names_the_few_layers_another_recipe_helps() -> None:
    # Delayed scaling: one layer's input jumps 1000x above its history (and its output is
    # scaled back, so no other layer's tensors change), so its current cast clips it; any
    # recipe with current scales casts it as well as the others'.
    model = _model(recipe=amp8.Recipe(scaling="delayed"))
    for _ in range(2):
        _step(model, torch.randn(64, 64))
    model[5].register_forward_hook(lambda module, args, out: out * 1000)  # the Tanh before layer 6
    model[6].register_forward_hook(lambda module, args, out: out / 1000)
    with amp8.what_if(model) as found:
        _step(model, torch.randn(64, 64))
    tensor, gain, excess = found.standout_gains("rowwise")["6"]
    assert tensor == "input" and gain > 10 and excess > 10
    lines = found.advice()
    assert any(line.startswith("rowwise: +") and "on the input of 1 layer, 6 " in line
               and "the controller's next rung for them" in line for line in lines), lines
    assert all("of 8 layers" not in line for line in lines), "a recipe that helps every layer is no advice"
    console = Console(record=True, width=140, file=open("/dev/null", "w"))  # noqa: SIM115
    found.print(console)
    text = console.export_text()
    assert "what-if" in text and "rowwise" in text
    assert math.isfinite(found.worst("6", "mxfp8"))


def test_the_documented_block_prints_with_no_console(capsys: pytest.CaptureFixture) -> None:
    """docs/report.md's code, as written: ``found.print()`` prints to amp8's console."""
    model = _model(depth=2)
    with amp8.what_if(model) as found:
        model(torch.randn(32, 64)).pow(2).mean().backward()
    found.print()
    out = capsys.readouterr().out
    assert out.startswith("what-if: worst SQNR"), out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["0"], ["2"])}
    assert set(rows) == {"0", "2"} and all(len(cells) == 1 + len(WHAT_IF_RECIPES) for cells in rows.values()), out
    assert float(rows["0"][0]) == pytest.approx(found.worst("0", CURRENT), abs=0.05)
    assert "no other recipe stands out" in out or any(line in out for line in found.advice())


def test_the_block_is_not_its_result_and_says_how_to_get_it() -> None:
    block = amp8.what_if(_model(depth=2))
    with pytest.raises(AttributeError, match=r"write `with amp8\.what_if\(model\) as found:`.*found\.print\(\)"):
        block.print()
    with pytest.raises(AttributeError, match=r"found\.layers$"):
        block.layers  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        block.nonsense  # noqa: B018


def test_a_block_without_an_fp8_step_says_what_to_run(capsys: pytest.CaptureFixture) -> None:
    with amp8.what_if(_model(depth=2)) as found:
        pass
    found.print()
    assert "no FP8 layer ran inside `with amp8.what_if(model) as found:`" in capsys.readouterr().out
    assert found.layers == {} and found.advice() == []


def test_a_block_is_entered_once_and_unhooks_on_an_error() -> None:
    model = _model(depth=2)
    block = amp8.what_if(model)
    with pytest.raises(ZeroDivisionError), block as found:
        model(torch.randn(4, 64))
        1 / 0  # noqa: B018
    assert set(found.layers["0"]) == {"input", "weight"}, "the forward inside the block was recorded"
    found.layers.clear()
    _step(model, torch.randn(4, 64))
    assert found.layers == {}, "the hooks are gone: a step after the block records nothing"
    with pytest.raises(RuntimeError, match=r"call amp8\.what_if\(model\) again"), block:
        pass
