"""amp8.Controller: the ladder of rungs, the cap, stepping down, the schedule, rank
agreement and exact resume."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import multiprocess
import pytest
import torch
import torch.distributed as dist
from torch import nn

import amp8
from amp8.config.controller import ControllerConfig, HealthThresholds, PrecisionPhase
from amp8.config.gemms import GemmOperand, Signal
from amp8.config.recipe import GRANULARITY_LADDER
from amp8.frontend import default_recipe
from amp8.monitor.controller import STATE_DICT_KEY
from amp8.monitor.ladder import GemmState, candidate_steps
from amp8.tools.experiments.token_stress import TokenRun, TokenSetup, TokenStress, train
from conftest import compact_state, mlp

OUTLIER = 2.0**22


def _build(config: ControllerConfig, level: str = "O2", recipe: amp8.Recipe | None = amp8.Recipe()):
    """An MLP 32-64-32 at ``level`` with ``recipe`` (None: the level's default) under a
    controller with ``config``."""
    model = mlp(32, 64, 32)
    controller = amp8.Controller(config)
    model, optimizer = amp8.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, recipe=recipe, controller=controller
    )
    return model, optimizer, controller


def _train(model, optimizer, steps: int, *, start: int = 0, outlier: bool = True, seed: int = 0) -> list[float]:
    """Steps ``start .. start + steps - 1`` on batches fixed by the step index; the first
    row of every batch is a token outlier that the loss ignores."""
    losses = []
    for step in range(start, start + steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed * 1000 + step))
        if outlier:
            x[0] *= OUTLIER
        optimizer.zero_grad()
        loss = model(x)[1:].square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


LADDER = ControllerConfig(interval=2, patience=1, max_high_precision_share=0.5)


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O1-compute"])
def test_a_token_outlier_walks_the_ladder_to_wgrads_outlier_split(level) -> None:
    model, optimizer, controller = _build(LADDER, level)
    _train(model, optimizer, 10)
    first = [move for move in controller.moves if move.layer == "0"]
    assert [(m.step, m.before, m.after) for m in first] == [
        (2, "tensorwise", "rowwise"), (4, "rowwise", "rowwise, wgrad outliers high"),
    ], "the split heals wgrad's casts: the layer goes no higher"
    assert first[0].reason.startswith("fprop input") and "flushed to zero" in first[0].reason
    assert first[0].reason.endswith("; rowwise")
    assert first[1].reason.startswith("wgrad input"), "per-row scales fix fprop, not wgrad"
    assert first[1].reason.endswith("; wgrad outlier split"), "token outliers in wgrad skip the block rung"
    assert controller.peak_signals()["0"]["underflow"] > 0.9
    assert model[0].gemm_granularity is amp8.config.Granularity.ROWWISE
    assert model[0].high_precision_gemms == (False, False, False) and model[0].splits_wgrad_outliers
    assert model[0].gemm_precision.tolist() == [1, 0, 0, 2]
    share = model[0].recipe.wgrad_outlier_share
    flops = {name: layer.in_features * layer.out_features for name, layer in _fp8_layers(model).items()}
    split = sum(flops[name] for name, rung in controller.rungs().items() if rung == "rowwise, wgrad outliers high")
    assert controller.fp8_share() == pytest.approx(1 - share * split / (3 * sum(flops.values())))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_without_the_split_rung_the_ladder_ends_in_high_precision_wgrad(level) -> None:
    config = dataclasses.replace(LADDER, split_wgrad_outliers=False)
    model, optimizer, controller = _build(config, level)
    _train(model, optimizer, 6)
    first = [move for move in controller.moves if move.layer == "0"]
    assert [(m.step, m.after) for m in first] == [(2, "rowwise"), (4, "rowwise, wgrad high")]
    assert model[0].high_precision_gemms == (False, False, True) and not model[0].splits_wgrad_outliers
    assert model[0].gemm_precision.tolist() == [1, 0, 0, 1]
    assert controller.fp8_share() < 1.0


def _fp8_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, amp8.nn.Fp8Linear)}


def test_the_cap_keeps_a_layer_in_fp8_with_one_warning_and_no_retries() -> None:
    """Beyond the cap, the split and then wgrad in high precision are refused once each
    per layer (one warning per layer), and not tried again at every later check."""
    model, optimizer, controller = _build(ControllerConfig(interval=2, patience=1, max_high_precision_share=0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, optimizer, 20)
    cap_warnings = [w for w in caught if "max_high_precision_share" in str(w.message)]
    assert len(cap_warnings) == len(controller.rungs()), "one warning per layer"
    refused = [m for m in controller.moves if m.reason.startswith("refused")]
    assert sorted((m.layer, m.reason.split(" would put")[0]) for m in refused) == [
        (layer, f"refused: {label}") for layer in sorted(controller.rungs())
        for label in ("wgrad high", "wgrad outlier split")
    ], "each refused move once per layer, in 10 checks"
    assert all(m.before == m.after == "rowwise" and m.step == 4 for m in refused)
    assert all(m.reason.endswith("not tried again for this layer") for m in refused)
    assert controller.fp8_share() == 1.0 and controller.high_precision_share() == 0.0


ROWWISE_STARTS = {"default-O1": None, "hybrid-rowwise": amp8.Recipe(granularity="rowwise")}


def _train_token_outliers(model, optimizer, steps: int, period: int, *, start: int = 0) -> None:
    """Steps on batches whose every ``period``-th token row is an outlier, left out of the loss."""
    kept = torch.arange(64) % period != 0
    for step in range(start, start + steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        x[~kept] *= OUTLIER
        optimizer.zero_grad()
        model(x)[kept].square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("start", list(ROWWISE_STARTS))
@pytest.mark.parametrize("period", [64, 16, 4])
def test_a_rowwise_start_takes_the_split_for_wgrads_token_outliers_never_the_block_rung(start, period) -> None:
    """Token outliers fail wgrad's casts along tokens: the first move is the outlier
    split, sized by the outliers' count (1/64, 1/16, 1/4 of the tokens), which heals
    the casts; no layer ever takes the block rung."""
    model, optimizer, controller = _build(LADDER, "O1", recipe=ROWWISE_STARTS[start])
    _train_token_outliers(model, optimizer, 12, period)
    assert all("block" not in move.after for move in controller.moves), controller.moves
    first = [move for move in controller.moves if move.layer == "0"]
    assert [(m.step, m.before, m.after) for m in first] == [(2, "rowwise", "rowwise, wgrad outliers high")], \
        "the split heals wgrad's casts: the layer goes no higher"
    assert first[0].reason.startswith("wgrad input") and first[0].reason.endswith("; wgrad outlier split")


def test_a_split_too_small_for_the_outliers_is_followed_by_wgrad_high() -> None:
    """The control of the test above: a split capped at 1/32 of the tokens cannot take
    out outliers at 1/4 of them, so wgrad's casts still fail and wgrad goes high."""
    recipe = default_recipe(amp8.config.levels.O1).replace(wgrad_outlier_share=1 / 32)
    model, optimizer, controller = _build(LADDER, "O1", recipe=recipe)
    _train_token_outliers(model, optimizer, 6, period=4)
    assert [(m.step, m.after) for m in controller.moves if m.layer == "0"] == [
        (2, "rowwise, wgrad outliers high"), (4, "rowwise, wgrad high")]


@pytest.mark.parametrize(("state", "failing", "labels"), [
    (("rowwise", False), {"WGRAD_INPUT"}, ["wgrad outlier split", "wgrad high"]),
    (("rowwise", False), {"WGRAD_GRAD_OUTPUT", "WGRAD_INPUT"}, ["wgrad outlier split", "wgrad high"]),
    (("rowwise", True), {"WGRAD_INPUT"}, ["wgrad high"]),
    (("block", False), {"WGRAD_INPUT"}, ["wgrad outlier split", "wgrad high"]),
    (("rowwise", False), {"FPROP_INPUT"}, ["block", "fprop high"]),
    (("rowwise", False), {"FPROP_WEIGHT"}, ["fprop high"]),
    (("block", False), {"DGRAD_GRAD_OUTPUT"}, ["dgrad high"]),
    (("rowwise", False), {"FPROP_INPUT", "WGRAD_INPUT"}, ["wgrad outlier split", "wgrad high", "block", "fprop high"]),
    (("tensorwise", False), {"FPROP_INPUT", "WGRAD_INPUT"},
     ["rowwise", "wgrad outlier split", "wgrad high", "block", "fprop high"]),
    (("tensorwise", False), set(), []),
])
def test_the_rung_order_follows_the_failing_operand(state, failing, labels) -> None:
    granularity, split = state
    now = GemmState(GRANULARITY_LADDER.index(amp8.config.Granularity(granularity)), (False, False, False), split)
    steps = candidate_steps(now, {GemmOperand[name] for name in failing})
    assert [step.label for step in steps] == labels
    assert all(step.state.rung >= now.rung for step in steps), "never coarser than where the layer stands"


def _fail(layer: nn.Module, operand: GemmOperand, underflow: float) -> None:
    """Write a watched step's signals: ``operand`` flushes ``underflow``, the rest nothing."""
    layer.health.zero_()
    layer.health[:, Signal.AMAX] = 1.0
    layer.health[operand, Signal.UNDERFLOW] = underflow


@pytest.mark.parametrize(("operand", "move", "label", "next_move"), [
    (GemmOperand.WGRAD_INPUT, "rowwise, wgrad outliers high", "wgrad outlier split", "rowwise, wgrad high"),
    (GemmOperand.FPROP_INPUT, "block", "block", "rowwise, fprop high"),
])
def test_a_move_whose_signals_got_worse_is_undone_and_the_next_rung_taken(operand, move, label, next_move) -> None:
    model, _, controller = _build(ControllerConfig(interval=1, patience=1, max_high_precision_share=0.5), "O1",
                                  recipe=None)
    layer = model[0]
    for underflow in (0.05, 0.5, 0.5, 0.0, 0.05):  # fails; worse after the move; as bad; healthy; fails again
        _fail(layer, operand, underflow)
        controller.after_step()
    moves = [(m.step, m.before, m.after, m.reason.split(":")[0]) for m in controller.moves]
    assert moves == [
        (1, "rowwise", move, operand.label),
        (2, move, "rowwise", "undone"),
        (2, "rowwise", next_move, operand.label),
    ], "the high-precision rung does not change the watched cast: kept, and nothing is left to try"
    assert controller.state_dict()["layers"]["0"]["closed"] == [label], "never tried again for this layer"


@pytest.mark.parametrize("after", [0.0, 0.05, 0.054])
def test_a_move_that_did_not_make_its_signals_worse_is_kept(after) -> None:
    model, _, controller = _build(ControllerConfig(interval=1, patience=1, max_high_precision_share=0.5), "O1",
                                  recipe=None)
    for underflow in (0.05, after):
        _fail(model[0], GemmOperand.WGRAD_INPUT, underflow)
        controller.after_step()
    assert [m.after for m in controller.moves] == ["rowwise, wgrad outliers high"] + (
        ["rowwise, wgrad high"] if after > 0.01 else []), "still failing: the next rung at once"
    assert not any(m.reason.startswith("undone") for m in controller.moves)


def test_a_move_that_heals_one_operand_while_another_grows_is_kept() -> None:
    """Under one scale per tensor the fprop and wgrad inputs share a cast; rowwise heals
    fprop while a growing outlier worsens wgrad: the move helped and stays."""
    model, _, controller = _build(ControllerConfig(interval=1, patience=1, max_high_precision_share=0.5), "O1")
    layer = model[0]
    _fail(layer, GemmOperand.FPROP_INPUT, 0.3)
    layer.health[GemmOperand.WGRAD_INPUT, Signal.UNDERFLOW] = 0.3
    controller.after_step()
    _fail(layer, GemmOperand.WGRAD_INPUT, 0.9)
    controller.after_step()
    assert [(m.before, m.after) for m in controller.moves if m.layer == "0"] == [
        ("tensorwise", "rowwise"), ("rowwise", "rowwise, wgrad outliers high")]


@pytest.mark.parametrize(("underflow", "moved_at"), [(0.5, 1), (0.11, 1), (0.09, 3), (0.02, 3)])
def test_a_layer_far_beyond_a_threshold_moves_without_waiting_for_patience(underflow, moved_at) -> None:
    """10 times the 1 % threshold is no noise: the layer moves at the first check."""
    model, _, controller = _build(ControllerConfig(interval=1, patience=3), "O1", recipe=None)
    for _ in range(3):
        _fail(model[0], GemmOperand.WGRAD_INPUT, underflow)
        controller.after_step()
    assert [m.step for m in controller.moves if m.layer == "0"][:1] == [moved_at]


def test_the_controller_does_not_end_worse_than_none_on_a_small_stress() -> None:
    """Token outliers at 1/16 of the tokens in three of four layers, default O1 recipe:
    with the controller, the run ends below the run without it, and takes back most of
    what the stress cost."""
    setup = TokenSetup(widths=(32, 64, 64, 32), tokens=32, batch_size=4, steps=60, warmup=5, eval_batches=2)
    stress = TokenStress(share=1 / 16, layer=1)
    plain = train(TokenRun("O1", stress=stress), seed=0, setup=setup)["final_val_loss"]
    controlled = train(TokenRun("O1", controller=ControllerConfig(), stress=stress), seed=0, setup=setup)
    unstressed = train(TokenRun("O1"), seed=0, setup=setup)["final_val_loss"]
    assert controlled["moves"], "the stress moved layers"
    assert controlled["final_val_loss"] <= plain, (controlled["final_val_loss"], plain)
    assert controlled["final_val_loss"] - unstressed < 0.5 * (plain - unstressed), (controlled, plain, unstressed)


def test_normal_training_moves_nothing() -> None:
    model, optimizer, controller = _build(ControllerConfig(interval=2, patience=1))
    _train(model, optimizer, 12, outlier=False)
    assert controller.moves == []
    assert set(controller.rungs().values()) == {"tensorwise"}
    peaks = controller.peak_signals()
    assert all(0 <= peak["underflow"] < 0.01 and peak["saturated"] == 0 for peak in peaks.values()), peaks


def test_a_layer_healthy_again_steps_back_down() -> None:
    model, optimizer, controller = _build(
        ControllerConfig(interval=2, patience=1, step_down_after=2, max_high_precision_share=0.5)
    )
    _train(model, optimizer, 4)
    assert controller.rungs()["0"] == "rowwise, wgrad outliers high"
    _train(model, optimizer, 12, start=4, outlier=False)
    downs = [m for m in controller.moves if m.layer == "0" and m.reason.startswith("healthy")]
    assert [(m.before, m.after) for m in downs] == [("rowwise, wgrad outliers high", "rowwise"),
                                                    ("rowwise", "tensorwise")]
    assert controller.rungs()["0"] == "tensorwise"


@pytest.mark.parametrize("start", [6, 0.6])
def test_the_schedule_moves_the_named_gemms_from_its_step(start) -> None:
    phase = PrecisionPhase(start=start, high=("fprop", "dgrad"), layers=("2",))
    model, optimizer, controller = _build(ControllerConfig(adapt=False, schedule=(phase,), total_steps=10))
    seen = []
    for step in range(8):
        seen.append(model[2].high_precision_gemms)
        _train(model, optimizer, 1, start=step)
        assert not model[0].watch_health and not model[2].watch_health, "adapt=False watches nothing"
    assert seen[:6] == [(False, False, False)] * 6 and seen[6:] == [(True, True, False)] * 2
    assert model[0].high_precision_gemms == (False, False, False)
    assert [(m.step, m.layer, m.reason) for m in controller.moves] == [(6, "2", "schedule")]


@pytest.mark.parametrize(("layers", "high"), [("2", "wgrad"), (("2",), ("wgrad",))])
def test_a_phase_takes_one_name_as_a_string(layers, high) -> None:
    """``layers="blocks.11.*"`` is one pattern (not one per character), and
    ``high="wgrad"`` one GEMM."""
    phase = PrecisionPhase(start=0, high=high, layers=layers)
    assert (phase.layers, phase.high) == (("2",), ("wgrad",))
    assert phase.covers("2") and not phase.covers("0")
    model, optimizer, _ = _build(ControllerConfig(adapt=False, schedule=(phase,)))
    _train(model, optimizer, 1)
    assert model[2].high_precision_gemms == (False, False, True)
    assert model[0].high_precision_gemms == (False, False, False)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ControllerConfig(interval=0), "interval"),
        (lambda: ControllerConfig(patience=1.5), "patience"),
        (lambda: ControllerConfig(max_high_precision_share=1.5), "max_high_precision_share"),
        (lambda: ControllerConfig(step_down_after=0), "step_down_after"),
        (lambda: ControllerConfig(urgent_excess=1.0), "urgent_excess=1.0 is not valid; use a ratio > 1 or None"),
        (lambda: ControllerConfig(schedule=(PrecisionPhase(start=0.9),)), "total_steps"),
        (lambda: HealthThresholds(underflow=0.0), "underflow"),
        (lambda: HealthThresholds(amax_growth=0.5), "amax_growth"),
        (lambda: PrecisionPhase(start=10, high=("bprop",)), "fprop, dgrad, wgrad"),
        (lambda: PrecisionPhase(start=-1), "step >= 0"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_initialize_checks_the_controller_before_changing_anything() -> None:
    model = mlp(32, 64, 32)
    with pytest.raises(ValueError, match="needs the optimizer"):
        amp8.initialize(model, None, "O1", controller=amp8.Controller(), recipe=amp8.Recipe())
    with pytest.raises(TypeError, match="amp8.Controller"):
        amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", controller=LADDER, recipe=amp8.Recipe())
    assert isinstance(model[0], nn.Linear), "nothing was swapped"
    controller = amp8.Controller()
    amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", controller=controller, recipe=amp8.Recipe())
    other = mlp(32, 64, 32)
    with pytest.raises(RuntimeError, match="one Controller per model"):
        amp8.initialize(other, torch.optim.AdamW(other.parameters()), "O1", controller=controller, recipe=amp8.Recipe())


@pytest.mark.parametrize(("level", "steps"), [("O1", 5), ("O3", 5), ("O1", 7), ("O3", 7)])
def test_resume_after_a_move_is_bit_exact(level, steps) -> None:
    """A checkpoint taken after layers moved (model and optimizer state dicts) resumes
    with the same rungs, counters and decisions: the same weights, bit for bit. After 7
    steps the layers split wgrad's outlier tokens off."""
    model, optimizer, controller = _build(LADDER, level)
    _train(model, optimizer, steps)
    assert controller.moves, "the checkpoint is taken after a move"
    saved = copy.deepcopy({"model": compact_state(model), "optimizer": optimizer.state_dict()})
    assert saved["optimizer"][STATE_DICT_KEY]["step"] == steps
    _train(model, optimizer, 5, start=steps)

    resumed_model, resumed_optimizer, resumed_controller = _build(LADDER, level)
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert resumed_controller.rungs() == {name: rung for name, rung in _rungs_at(saved).items()}
    _train(resumed_model, resumed_optimizer, 5, start=steps)
    assert resumed_controller.moves == controller.moves
    for key, value in compact_state(model).items():
        assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                           _bytes(compact_state(resumed_model)[key])), key


def _bytes(value: torch.Tensor) -> torch.Tensor:
    return value.view(torch.uint8) if value.element_size() == 1 else value


def _rungs_at(saved: dict) -> dict[str, str]:
    names = {0: "tensorwise", 1: "rowwise", 2: "block"}
    rungs = {}
    for key, value in saved["model"].items():
        if key.endswith("gemm_precision"):
            granularity, *high = value.tolist()
            flags = [gemm for gemm, flag in zip(("fprop", "dgrad", "wgrad"), high) if flag == 1]
            flags += ["wgrad outliers"] * (high[-1] == 2)
            rungs[key.removesuffix(".gemm_precision")] = names[granularity] + (f", {'+'.join(flags)} high" if flags else "")
    return rungs


def test_a_model_checkpoint_keeps_the_gemm_precision_and_loads_old_ones() -> None:
    model, optimizer, _ = _build(LADDER)
    _train(model, optimizer, 4)
    state = compact_state(model)
    fresh, _ = amp8.initialize(mlp(32, 64, 32), None, "O2", recipe=amp8.Recipe())
    fresh.load_state_dict(state)
    assert fresh[0].gemm_granularity is amp8.config.Granularity.ROWWISE and fresh[0].splits_wgrad_outliers
    x = torch.randn(8, 32)
    assert torch.equal(fresh(x), model(x))
    old = {k: v for k, v in state.items() if not k.endswith("gemm_precision")}
    older, _ = amp8.initialize(mlp(32, 64, 32), None, "O2", recipe=amp8.Recipe())
    older.load_state_dict(old)
    assert older[0].gemm_granularity is amp8.config.Granularity.TENSORWISE


def _step_reading_health(model, layer: nn.Module, optimizer, step: int, *, outlier: bool) -> torch.Tensor:
    """One step of ``_train`` (``model`` may be compiled) that returns ``layer``'s health
    as its casts wrote it, read between the backward and the optimizer step (whose check
    clears it)."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
    if outlier:
        x[0] *= OUTLIER
    optimizer.zero_grad()
    model(x)[1:].square().mean().backward()
    health = layer.health.clone()
    optimizer.step()
    return health


@pytest.mark.compile
def test_a_compiled_model_is_watched_and_moved() -> None:
    """Compiled casts write the signals the controller reads, and a move reaches the
    compiled graph. Every signal sits far from the 1 % underflow threshold, so kernels of
    any vector width (``ATEN_CPU_CAPABILITY``) decide alike: healthy batches flush ~0 %
    of layer 0's input and nothing moves; one token 2**22 times the others flushes all
    the others (~98 %) under one scale per tensor and the layer moves to rowwise scales,
    under which the compiled cast flushes ~0 % again. (Which rung comes after that is
    the eager tests' business.)"""
    model, optimizer, controller = _build(LADDER, "O1")
    compiled = torch.compile(model)
    input_underflow = []
    for step in range(6):
        outlier = step >= 2
        health = _step_reading_health(compiled, model[0], optimizer, step, outlier=outlier)
        if step % 2 == 1:  # the steps before the checks (2, 4, 6) are watched
            input_underflow.append(float(health[GemmOperand.FPROP_INPUT, Signal.UNDERFLOW]))
            assert float(health[GemmOperand.FPROP_INPUT, Signal.AMAX]) > (1e6 if outlier else 1), \
                "the compiled cast wrote the input's amax"
        else:
            assert not health.any(), "an unwatched step writes nothing"
        if step == 1:
            assert controller.moves == [], "healthy casts move nothing"
    healthy, outlier_tensorwise, outlier_rowwise = input_underflow
    assert healthy < 0.001 and outlier_tensorwise > 0.9 and outlier_rowwise < 0.001, input_underflow
    first = [move for move in controller.moves if move.layer == "0"][0]
    assert (first.step, first.before, first.after) == (4, "tensorwise", "rowwise"), controller.moves
    assert "flushed to zero (threshold 1 %)" in first.reason, first.reason
    assert not any(move.reason.startswith("undone") for move in controller.moves), "the move healed its cast"


# -- two ranks ------------------------------------------------------------------------
def _two_ranks(rank: int, world: int) -> dict:
    """The outlier is in rank 0's batches only: rank 1 alone would see healthy casts, but
    both ranks take the largest signals and move alike."""
    model, optimizer, controller = _build(LADDER)
    _train(model, optimizer, 5, outlier=False, seed=rank)  # warm up without moves
    for step in range(5, 9):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank * 1000 + step))
        if rank == 0:
            x[0] *= OUTLIER
        optimizer.zero_grad()
        model(x)[1:].square().mean().backward()
        optimizer.step()
    saved = copy.deepcopy({"model": compact_state(model), "optimizer": optimizer.state_dict()})
    _train(model, optimizer, 3, start=9, seed=rank)
    resumed_model, resumed_optimizer, resumed_controller = _build(LADDER)
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _train(resumed_model, resumed_optimizer, 3, start=9, seed=rank)
    same = all(torch.equal(_bytes(v), _bytes(compact_state(resumed_model)[k])) for k, v in compact_state(model).items())
    dist.barrier()
    return {"moves": controller.moves, "resumed_moves": resumed_controller.moves, "bit_exact": same}


@pytest.mark.multiprocess
def test_ranks_agree_on_every_move_and_resume_exactly(tmp_path) -> None:
    results = multiprocess.run(_two_ranks, tmp_path)
    assert results[0]["moves"], "rank 0's outlier moved layers"
    assert results[0]["moves"] == results[1]["moves"]
    for result in results:
        assert result["resumed_moves"] == result["moves"]
        assert result["bit_exact"]


def test_the_report_shows_each_layers_gemms_and_moves() -> None:
    model, optimizer, controller = _build(LADDER)
    _train(model, optimizer, 4)
    precision = amp8.report(model, optimizer)
    rows = {row.name: row for row in precision.rows}
    assert rows["0.weight"].gemms == "rowwise, wgrad outliers high"
    assert [move.after for move in rows["0.weight"].moves] == ["rowwise", "rowwise, wgrad outliers high"]
    assert len(precision.moves()) == len(controller.moves)
    assert any(line.startswith("GEMMs moved: 0.weight (rowwise, wgrad outliers high)") for line in precision.highlights())
    from rich.console import Console

    console = Console(record=True, width=200)
    precision.print(console)
    text = console.export_text()
    assert "GEMMs" in text and "step 2: 0 tensorwise -> rowwise (fprop input" in text
    assert amp8.monitor.PrecisionReport.from_dict(precision.to_dict()).moves() == precision.moves()


@pytest.mark.integration
def test_accelerate_steps_and_checkpoints_the_controller() -> None:
    """Through Accelerate's optimizer wrapper and gradient accumulation, the controller
    counts optimizer steps (not micro-batches) and its state is in the wrapper's
    ``state_dict``."""
    from accelerate import Accelerator

    model, optimizer, controller = _build(LADDER)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(8):  # 8 micro-batches: 4 optimizer steps
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        x[0] *= OUTLIER
        with accelerator.accumulate(model):
            accelerator.backward(model(x)[1:].square().mean())
            optimizer.step()
            optimizer.zero_grad()
    assert controller.step == 4
    assert [(m.step, m.after) for m in controller.moves if m.layer == "0"] == [
        (2, "rowwise"), (4, "rowwise, wgrad outliers high")]
    assert optimizer.state_dict()[STATE_DICT_KEY]["step"] == 4


def test_a_corrupt_gemm_precision_is_refused_by_name() -> None:
    model, _ = amp8.initialize(mlp(32, 64, 32), None, "O2", recipe=amp8.Recipe())
    state = compact_state(model)
    for corrupt in ([7, 0, 0, 0], [2, 2, 0, 0], [2, 0, 0, 3]):
        state["0.gemm_precision"] = torch.tensor(corrupt)
        with pytest.raises(ValueError, match=r"0\.gemm_precision .* is not a GEMM precision"):
            model.load_state_dict(state)
