"""The precision report's default view: repeated blocks folded, what needs attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rich.console import Console
from torch import nn

import amp8
from amp8.config.controller import Move
from amp8.monitor import PrecisionReport
from amp8.monitor.report_fold import fold_names, fold_rows, folded_name, pattern_of


@pytest.mark.parametrize(("names", "expected"), [
    ([f"layers.{i}.mlp.weight" for i in range(32)], ["layers.{0..31}.mlp.weight"]),
    ([f"layers.{i}.w" for i in (0, 1, 2, 3, 5, 7, 8)], ["layers.{0..3,5,7,8}.w"]),
    (["layers.0.w", "layers.1.w"], ["layers.0.w", "layers.1.w"]),  # two stay two
    ([f"{i}.weight" for i in range(4)] + ["head.weight"], ["{0..3}.weight", "head.weight"]),
    ([f"blocks.{b}.experts.{e}.w" for b in range(3) for e in range(2)], ["blocks.{0..2}.experts.{0,1}.w"]),
    ([f"blocks.{b}.experts.{e}.w" for b in range(3) for e in (4,)], ["blocks.{0..2}.experts.4.w"]),
])
def test_names_fold_by_their_numeric_components(names: list[str], expected: list[str]) -> None:
    folded = fold_names(names)
    assert [entry.name for entry in folded] == expected
    assert sorted(position for entry in folded for position in entry.members) == list(range(len(names)))


def test_names_with_other_keys_fold_apart_in_first_appearance_order() -> None:
    names = [f"layers.{i}.down.weight" for i in range(6)]
    keys = ["rowwise"] * 3 + ["block"] * 3
    assert [entry.name for entry in fold_names(names, keys)] == ["layers.{0..2}.down.weight", "layers.{3..5}.down.weight"]
    assert pattern_of("model.layers.12.mlp.7") == ("model.layers.{}.mlp.{}", (12, 7))
    assert folded_name("a.{}.b.{}", [(1, 2), (1, 3)]) == "a.1.b.{2,3}"


def _llama(layers: int, level: str = "O2") -> tuple[nn.Module, torch.optim.Optimizer]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _printed(report: PrecisionReport, width: int = 120, **kwargs: bool) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
    report.print(console, **kwargs)
    return console.export_text()


@pytest.mark.integration
def test_a_32_layer_llama_prints_within_60_lines_at_120_columns() -> None:
    model, optimizer = _llama(32)
    report = amp8.report(model, optimizer)
    text = _printed(report)
    assert len(text.splitlines()) <= 60, text
    assert len(_printed(report, full=True).splitlines()) > 700, "the full table keeps a row per tensor"
    assert text.startswith("amp8 precision report: " + report.summary()[:40]), "the summary comes first"
    assert "model.layers.{0..31} x32" in text
    for role in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert sum(f"  {role} " in line for line in text.splitlines()) == 1, role
    assert "high precision: lm_head.weight: output head" in text
    assert "every tensor: print(full=True)" in text


@pytest.mark.integration
def test_a_folded_row_gives_the_spread_over_blocks_and_names_the_worst() -> None:
    model, optimizer = _llama(4)
    report = amp8.report(model, optimizer)
    rows = [row for row in report.rows if row.name.endswith("mlp.down_proj.weight")]
    # block 2's down_proj flushes a quarter of its weights
    report.rows[report.rows.index(rows[2])] = dataclasses.replace(rows[2], underflow=0.25)
    (entry,) = [entry for entry in fold_rows(report.rows) if entry.name.endswith("mlp.down_proj.weight")]
    amaxes = sorted(row.amax for row in rows)
    assert entry.count == 4 and entry.spread("amax") == (amaxes[0], (amaxes[1] + amaxes[2]) / 2, amaxes[3])
    assert entry.worst("underflow") == "model.layers.2.mlp.down_proj.weight"
    text = " ".join(_printed(report).split())
    assert "underflow hot spots: model.layers.{0..3}.mlp.down_proj.weight up to 25% (model.layers.2)" in text


def test_a_two_block_model_prints_every_row_as_the_full_table() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)])
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=amp8.Recipe())
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    report = amp8.report(model, optimizer)
    assert _printed(report) == _printed(report, full=True)


def test_moves_of_several_blocks_fold_into_one_line() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32)) for _ in range(4)])
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=amp8.Recipe())
    for index in (1, 2, 3):  # as amp8.Controller moves a layer
        model[index][0].set_gemm_precision("rowwise", (False, False, False))
        model[index][0].gemm_moves.append(Move(7, f"{index}.0", "tensorwise", "rowwise", "underflow"))
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    text = " ".join(_printed(amp8.report(model, optimizer)).split())
    assert "step 7: {1..3}.0 tensorwise -> rowwise (underflow)" in text
    assert "{1..3}.0.weight" in text and "0.0.weight" in text, "moved layers fold apart from the others"
