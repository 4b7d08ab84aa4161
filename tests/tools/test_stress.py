"""The outlier stress case: its config, its invisibility in exact arithmetic, the
injection itself, what it does to FP8 casts, and its run through ``compare``."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.tools.cli import main
from amp8.tools.experiments.compare import JSON_NAME, CompareConfig, RunSpec, train_run, validation_batches
from amp8.tools.experiments.corpus import CorpusConfig, load_corpus, sample_batch
from amp8.tools.experiments.gpt import GPT, PRESETS
from amp8.tools.experiments.stress import (
    IGNORE_INDEX, OutlierInjection, OutlierStress, UnderflowProbe, mask_position, stressed_layer, underflow_share,
)
from amp8.tools.experiments.token_stress import IGNORED_SHARE, TokenRun, TokenSetup, TokenStress, train
from conftest import load_study

TINY = PRESETS["tiny"]
CORPUS = CorpusConfig(max_bytes=64 * 1024)
FULL_GAIN = OutlierStress(max_log2_gain=24.0, ramp_fraction=0.0)  # 2**24 from the first step


def _batch(batch_size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_corpus(CORPUS).train
    x, y = sample_batch(data, batch_size, TINY.block_size, torch.Generator().manual_seed(seed))
    return x, mask_position(y, 0)


def _capture_input(layer: nn.Module, into: list[torch.Tensor]) -> None:
    layer.register_forward_pre_hook(lambda module, args: into.append(args[0].detach().clone()))


# -- config ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("block", 1.0), ("block", True), ("position", -1), ("max_log2_gain", -1.0), ("max_log2_gain", 40.0),
     ("max_log2_gain", float("nan")), ("ramp_fraction", 1.5), ("ramp_fraction", "0.3")],
)
def test_stress_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"OutlierStress.{field}="):
        OutlierStress(**{field: value})


@pytest.mark.parametrize("changes, message", [({"block": 2}, "OutlierStress.block=2 does not exist"),
                                              ({"block": -3}, "OutlierStress.block=-3 does not exist"),
                                              ({"position": 64}, "OutlierStress.position=64 is not a position")])
def test_stress_must_fit_the_model(changes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompareConfig(model=TINY, stress=OutlierStress(**changes))


def test_compare_config_takes_only_an_outlier_stress() -> None:
    with pytest.raises(TypeError, match="CompareConfig.stress must be an OutlierStress or None, got dict"):
        CompareConfig(stress={"block": -1})  # type: ignore[arg-type]


def test_gain_ramps_in_log2_from_one() -> None:
    stress = OutlierStress(max_log2_gain=24.0, ramp_fraction=0.3)
    assert stress.gain(0, 300) == 1.0
    assert stress.gain(45, 300) == 2.0**12
    assert stress.gain(90, 300) == stress.gain(299, 300) == 2.0**24
    assert FULL_GAIN.gain(0, 300) == 2.0**24, "ramp_fraction=0 gives the full gain at once"


# -- the injection -----------------------------------------------------------------------
def test_injection_scales_exactly_the_stressed_row() -> None:
    model = GPT(TINY, torch.Generator().manual_seed(0))
    layer = stressed_layer(model, FULL_GAIN)
    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    _capture_input(layer, before)
    injection = OutlierInjection(OutlierStress(max_log2_gain=20.0, ramp_fraction=0.5), steps=10)
    injection.attach(model)
    _capture_input(layer, after)
    injection.step = 3  # log2 gain 20 * 3 / 5 = 12
    model(_batch()[0])
    (x,), (scaled,) = before, after
    assert injection.gain == 2.0**12
    torch.testing.assert_close(scaled[:, 0], x[:, 0] * 2.0**12, atol=0, rtol=0)
    torch.testing.assert_close(scaled[:, 1:], x[:, 1:], atol=0, rtol=0)


def test_injection_is_invisible_in_exact_arithmetic() -> None:
    """The stressed row reaches only position 0's logits, which the loss ignores: O0's
    loss and every gradient are those of the unstressed model."""
    x, y = _batch()
    plain, stressed = (GPT(TINY, torch.Generator().manual_seed(0)) for _ in range(2))
    OutlierInjection(FULL_GAIN, steps=1).attach(stressed)
    losses = []
    for model in (plain, stressed):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=0)
    for (name, a), b in zip(plain.named_parameters(), stressed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


def test_injection_survives_initialize_when_attached_after() -> None:
    model = GPT(TINY, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp8.initialize(model, optimizer, "O1", layer_selection="all", recipe=amp8.Recipe())
    layer = stressed_layer(model, FULL_GAIN)
    assert isinstance(layer, Fp8Linear)
    OutlierInjection(FULL_GAIN, steps=1).attach(model)
    inputs: list[torch.Tensor] = []
    _capture_input(layer, inputs)
    model(_batch()[0])
    assert inputs[0][:, 0].abs().amax() > 2.0**20 * inputs[0][:, 1:].abs().amax()


# -- what it does to FP8 casts -----------------------------------------------------------
def test_large_gain_flushes_tensorwise_casts_but_not_rowwise() -> None:
    model = GPT(TINY, torch.Generator().manual_seed(0))
    OutlierInjection(FULL_GAIN, steps=1).attach(model)
    inputs: list[torch.Tensor] = []
    _capture_input(stressed_layer(model, FULL_GAIN), inputs)
    model(_batch()[0])
    x = inputs[0]  # (B, T, 4C), row 0 of each sequence scaled by 2**24
    tensorwise, rowwise = amp8.Recipe(), amp8.Recipe.preset("rowwise")
    assert underflow_share(x, tensorwise) > 0.9, "tensorwise: the outlier rows set the scale"
    assert underflow_share(x, rowwise, contract_dim=1) < 0.01, "rowwise fprop: one scale per token row"
    assert underflow_share(x, rowwise, contract_dim=0) > 0.9, "rowwise wgrad: every column holds outliers"
    others = x[:, 1:]
    assert underflow_share(others, tensorwise) < 0.01, "without the outlier rows the cast holds"


def test_probe_measures_the_scaled_input_at_its_steps() -> None:
    config = CompareConfig(model=TINY, steps=4, batch_size=4, eval_interval=4, eval_batches=1, train_loss_window=1,
                           torchao=False, ablation=False, corpus=CORPUS,
                           stress=OutlierStress(max_log2_gain=24.0, ramp_fraction=0.5))
    corpus = load_corpus(config.corpus)
    probe = UnderflowProbe(config.stress, {0, 2, 3})  # type: ignore[arg-type]
    train_run(RunSpec("O1", "O1", 0), config, corpus, validation_batches(config, corpus),
              on_step=probe.on_step, on_model=probe.attach)
    assert sorted(probe.shares) == [0, 2, 3]
    assert probe.shares[0]["tensorwise"] < 0.01, "gain 1 at step 0"
    assert probe.shares[3]["tensorwise"] > 0.9, "gain 2**24 from step 2"
    assert probe.shares[3]["rowwise_fprop"] < 0.01


# -- through compare ---------------------------------------------------------------------
def test_validation_batches_ignore_the_stressed_position() -> None:
    config = CompareConfig(model=TINY, eval_batches=2, batch_size=4, corpus=CORPUS, stress=OutlierStress())
    corpus = load_corpus(config.corpus)
    for (_, y), (_, y_plain) in zip(validation_batches(config, corpus),
                                    validation_batches(config.replace(stress=None), corpus)):
        assert (y[:, 0] == IGNORE_INDEX).all()
        assert torch.equal(y[:, 1:], y_plain[:, 1:])


def test_compare_runs_and_records_the_stress(tmp_path: Path) -> None:
    stress = OutlierStress(max_log2_gain=20.0, ramp_fraction=0.5)
    config = CompareConfig(model=TINY, steps=4, batch_size=4, eval_interval=2, eval_batches=2, train_loss_window=2,
                           levels=("O0", "O1"), ablation=False, torchao=False, corpus=CORPUS, stress=stress)
    result = amp8.compare(config, out_dir=tmp_path, console=Console(file=io.StringIO()), progress=False, plot=False)
    assert [run.name for run in result.runs if run.ok] == ["O0", "O1"]
    assert all(torch.isfinite(torch.tensor(run.final_val_loss)) for run in result.runs)
    assert json.loads((tmp_path / JSON_NAME).read_text())["config"]["stress"] == stress.to_dict()


def test_cli_stress_flag(tmp_path: Path) -> None:
    argv = ["compare", "--preset", "tiny", "--steps", "2", "--batch-size", "4", "--levels", "O0", "--no-ablation",
            "--no-torchao", "--no-progress", "--max-bytes", str(64 * 1024), "--out", str(tmp_path), "--stress"]
    assert main(argv) == 0
    assert json.loads((tmp_path / JSON_NAME).read_text())["config"]["stress"] == OutlierStress().to_dict()


@pytest.mark.slow
def test_bench_writes_losses_gaps_and_underflow(tmp_path: Path) -> None:
    bench = load_study("stress")
    path = bench.main(["--preset", "tiny", "--steps", "4", "--seeds", "0", "--probe-every", "2",
                       "--variants", "O0", "O1-tensorwise", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert [(run["variant"], [p["step"] for p in run["underflow"]]) for run in record["runs"]] == [
        ("O0", [0, 2]), ("O1-tensorwise", [0, 2])]
    assert record["runs"][0]["gap_percent"] == 0.0 and record["stress"] == OutlierStress().to_dict()
    assert "| O1-tensorwise |" in path.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("stressed", [True, False])
def test_the_controller_moves_the_stressed_layer_and_nothing_else(tmp_path: Path, stressed: bool) -> None:
    """Under the stress, the controller moves the last MLP's down-projection to rowwise
    scales (fprop's cast) and then splits wgrad's outlier tokens off (its casts along
    tokens stay dark at any granularity), and leaves every other layer in
    tensorwise FP8, with far more than 90 % of GEMM FLOPs in FP8; without it, nothing moves
    (``--controller`` runs a level once more with ``amp8.Controller``)."""
    stress = OutlierStress(max_log2_gain=24.0, ramp_fraction=0.2) if stressed else None
    config = CompareConfig(model=TINY, steps=50, batch_size=4, eval_interval=50, eval_batches=2, train_loss_window=2,
                           levels=("O0",), ablation=False, torchao=False, corpus=CORPUS, stress=stress,
                           recipe=amp8.Recipe(), controller_levels=("O1",), controller=amp8.ControllerConfig(interval=5))
    result = amp8.compare(config, out_dir=tmp_path, console=Console(file=io.StringIO()), progress=False, plot=False)
    run = next(run for run in result.runs if run.name == "O1+controller")
    if not stressed:
        assert run.controller_moves == [] and run.gemm_fp8_share == 1.0
        return
    assert {move["layer"] for move in run.controller_moves} == {"blocks.1.mlp.proj"}
    assert [move["after"] for move in run.controller_moves] == ["rowwise", "rowwise, wgrad outliers high"]
    assert 0.9 < run.gemm_fp8_share < 1.0
    rows = {row["name"]: row for row in run.report["rows"]}
    assert rows["blocks.1.mlp.proj.weight"]["gemms"] == "rowwise, wgrad outliers high"
    saved = json.loads((tmp_path / JSON_NAME).read_text())
    assert saved["config"]["controller_levels"] == ["O1"]


@pytest.mark.slow
@pytest.mark.parametrize("stressed", [True, False])
@pytest.mark.parametrize(("preset", "cap", "moved"), [
    ("mxfp8", 0.1, ["block, wgrad outliers high"]),
    ("nvfp4", 0.2, ["block, wgrad outliers high", "block, fprop+wgrad outliers high"]),
])
def test_the_controller_moves_a_microscaled_layer_past_its_last_granularity(
    tmp_path: Path, stressed: bool, preset: str, cap: float, moved: list[str]
) -> None:
    """Microscaled layers start on the ladder's last granularity, so a failing layer
    first splits wgrad's outlier tokens off, then puts what still fails in high
    precision. MXFP8 loses the stressed wgrad input to E4M3's range within its 32-blocks
    (the split heals it); NVFP4 loses whole blocks of the fprop and wgrad inputs, whose
    E4M3 block scales flush under the tensor scale the outlier sets, so fprop goes high
    next. NVFP4 rounds a share of every block to zero by design, which is not counted:
    unstressed, nothing moves."""
    stress = OutlierStress(max_log2_gain=24.0, ramp_fraction=0.2) if stressed else None
    config = CompareConfig(model=TINY, steps=50, batch_size=4, eval_interval=50, eval_batches=2, train_loss_window=2,
                           levels=("O0",), ablation=False, torchao=False, corpus=CORPUS, stress=stress,
                           recipe=amp8.Recipe.preset(preset), controller_levels=("O1",),
                           controller=amp8.ControllerConfig(interval=5, max_high_precision_share=cap))
    result = amp8.compare(config, out_dir=tmp_path, console=Console(file=io.StringIO()), progress=False, plot=False)
    run = next(run for run in result.runs if run.name == "O1+controller")
    if not stressed:
        assert run.controller_moves == [] and run.gemm_fp8_share == 1.0
        assert max(peak["underflow"] for peak in run.controller_peaks.values()) < 0.01
        return
    assert [(move["layer"], move["after"]) for move in run.controller_moves] == [
        ("blocks.1.mlp.proj", after) for after in moved]
    assert "flushed" in run.controller_moves[0]["reason"]
    assert 0.85 < run.gemm_fp8_share < 1.0


# -- token outliers at a share of the tokens (amp8.tools.experiments.token_stress) -------
@pytest.mark.parametrize("share", [1 / 64, 1 / 16, 1 / 4])
@pytest.mark.parametrize("layer", [1, 3])
def test_token_outliers_change_nothing_in_exact_arithmetic(share: float, layer: int) -> None:
    """O0 trains bit for bit alike with and without the outliers: they sit on tokens the
    loss leaves out, and a token reaches only its own output."""
    setup = TokenSetup(widths=(16, 32, 32, 32, 16), batch_size=4, steps=6, warmup=2, eval_batches=1)
    stressed = train(TokenRun("O0", stress=TokenStress(share=share, layer=layer)), seed=0, setup=setup)
    plain = train(TokenRun("O0"), seed=0, setup=setup)
    assert stressed["final_val_loss"] == plain["final_val_loss"]


def test_the_token_outliers_are_among_the_tokens_the_loss_leaves_out() -> None:
    for share in (1 / 64, 1 / 16, 1 / 4):
        outliers = TokenStress(share=share).outlier_rows(8, 32)
        assert int(outliers.sum()) == round(share * 8 * 32)
        assert not (outliers & ~TokenStress(share=IGNORED_SHARE).outlier_rows(8, 32)).any()


@pytest.mark.parametrize(("changes", "match"), [
    ({"share": 0.0}, r"share=0.0 is not valid; use a share of tokens in \(0, 0.25\]"),
    ({"share": 0.5}, r"share=0.5 is not valid; use a share of tokens in \(0, 0.25\]"),
    ({"share": 1 / 6}, "use 1/4, 1/8, 1/16"),
    ({"layer": -1}, "layer=-1 is not valid"),
])
def test_bad_token_stress_settings_name_the_field_and_the_fix(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenStress(**changes)
