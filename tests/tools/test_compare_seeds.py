"""``amp8 compare`` over several seeds (paired gaps, their standard error, the null
variant, the gap panel of the PNG) and its choice of model, on results built by hand."""

from __future__ import annotations

import statistics

import pytest
from rich.console import Console

import amp8
from amp8.tools.cli import main
from amp8.tools.experiments import compare as runner
from amp8.tools.experiments import llama
from amp8.tools.experiments.compare import MODELS, CompareConfig, CompareResult, RunResult, model_config
from amp8.tools.experiments.compare_plot import gap_curve, mean_val_curve
from amp8.tools.experiments.gpt import PRESETS, GPTConfig
from amp8.tools.experiments.llama import LlamaSpec
from amp8.tools.experiments.paired import NULL

CONFIG = CompareConfig(model=PRESETS["tiny"], steps=4, eval_interval=2, train_loss_window=2, torchao=False)
VAL = {  # name -> one validation curve per seed, at steps 2 and 4
    "O0": [[3.0, 2.0], [3.2, 2.2], [3.1, 2.1]],
    "O1": [[3.03, 2.01], [3.2, 2.22], [3.1, 2.1]],
    NULL: [[3.0, 2.0], [3.2, 2.2], [3.1, 2.1]],
}


def _run(name: str, seed: int, val: list[float]) -> RunResult:
    return RunResult(name, "O0" if name != "O1" else "O1", seed, train_curve=[4.0, 3.5, 3.0, 2.5],
                     val_curve=[[2, val[0]], [4, val[1]]], final_train_loss=2.75, final_val_loss=val[1],
                     tokens_per_s=1000.0 + seed, bytes_per_param=16.0, fp8_share=0.0)


def _result(seeds: int) -> CompareResult:
    runs = [_run(name, seed, curves[seed]) for seed in range(seeds) for name, curves in VAL.items()
            if name != NULL or seeds > 1]
    return CompareResult(CONFIG.replace(seeds=seeds), runs, {}, {})


def _gaps(name: str, index: int, seeds: int = 3) -> list[float]:
    return [100 * (VAL[name][s][index] - VAL["O0"][s][index]) / VAL["O0"][s][index] for s in range(seeds)]


def _text(result: CompareResult) -> str:
    console = Console(record=True, width=250)
    result.print(console)
    return " ".join(console.export_text().split())


# -- several seeds -----------------------------------------------------------------------
def test_several_seeds_show_mean_and_standard_error_and_the_noise_floor() -> None:
    result = _result(3)
    gaps = _gaps("O1", 1)
    mean, error = statistics.fmean(gaps), statistics.stdev(gaps) / 3**0.5
    text = _text(result)
    assert result.gap_text("O1") == f"{mean:+.2f} ± {error:.2f}%"
    assert f"{mean:+.2f} ± {error:.2f}%" in text
    assert result.paired().mean_gap_percent("O1") == pytest.approx(mean, abs=1e-12)
    assert result.paired().stderr_percent("O1") == pytest.approx(error, abs=1e-12)
    assert f"noise floor: {NULL} (O0 from initial weights perturbed by 1e-06 relative) ends +0.00 ± 0.00% " \
           "from O0 over 3 seeds" in text
    assert "mean over seeds" in text and "seeds 0-2" in text
    assert text.count("│ O1 ") == 1, "one row per run name, not per seed"


def test_one_seed_shows_a_plain_gap_and_how_to_measure_the_noise() -> None:
    result = _result(1)
    text = _text(result)
    assert result.paired() is None
    assert result.gap_text("O1") == f"{_gaps('O1', 1, seeds=1)[0]:+.2f}%" and "±" not in result.gap_text("O1")
    assert "noise floor: one seed only; run with --seeds 3" in text


@pytest.mark.parametrize("name", ["O1", NULL])
def test_gap_curve_is_the_mean_paired_gap_at_each_evaluation(name: str) -> None:
    steps, gaps = gap_curve(_result(3), name)
    assert steps == [2, 4]
    assert gaps == pytest.approx([statistics.fmean(_gaps(name, i)) for i in (0, 1)], abs=1e-12)


def test_val_curve_is_the_mean_over_seeds() -> None:
    steps, losses = mean_val_curve(_result(3), "O1")
    assert steps == [2, 4] and losses == pytest.approx([statistics.fmean(c[i] for c in VAL["O1"]) for i in (0, 1)])


def test_run_picks_a_seed_and_names_the_seeds_it_has() -> None:
    result = _result(3)
    assert result.run("O1").seed == 0 and result.run("O1", 2).seed == 2 and result.seeds == (0, 1, 2)
    with pytest.raises(KeyError, match=r"no run 'O1' from seed 7 \(it ran from seeds 0, 1, 2\)"):
        result.run("O1", 7)


def test_png_gives_the_levels_a_gap_panel_of_their_own_with_the_seeds_spread() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from amp8.tools.experiments.compare_plot import loss_figure, seed_gap_curves

    result = _result(3)
    figure = loss_figure(result)
    try:
        train_ax, val_ax, level_ax, other_ax = figure.axes
        assert level_ax.get_title() == "opt levels: validation-loss gap to O0, mean over 3 seeds (band: the seeds' range)"
        levels = {line.get_label(): line for line in level_ax.get_lines()}
        others = {line.get_label(): line for line in other_ax.get_lines()}
        assert set(levels) == {"O0", "O1"} and set(others) == {"O0", NULL}, "the ablation on its own axis"
        assert list(levels["O0"].get_ydata()) == [0.0, 0.0], "the zero line"
        assert list(levels["O1"].get_ydata()) == pytest.approx(gap_curve(result, "O1")[1])
        # The band spans the seeds' gaps at each evaluation.
        (band,) = level_ax.collections
        _, per_seed = seed_gap_curves(result, "O1")
        low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
        assert low == pytest.approx(min(min(gaps) for gaps in per_seed))
        assert high == pytest.approx(max(max(gaps) for gaps in per_seed))
        assert {line.get_label() for line in val_ax.get_lines()} == {"O0", "O1", NULL}
    finally:
        plt.close(figure)


def test_png_of_one_seed_draws_no_band() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from amp8.tools.experiments.compare_plot import loss_figure

    figure = loss_figure(_result(1))
    try:
        assert all(not ax.collections for ax in figure.axes)
        assert figure.axes[2].get_title() == "opt levels: validation-loss gap to O0"
    finally:
        plt.close(figure)


# -- the model ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt", GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, tie_head=False)),
        ("gpt-tied", GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, tie_head=True)),
        pytest.param("llama", LlamaSpec(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, intermediate=176, block_size=32),
                     marks=pytest.mark.integration),
        pytest.param("moe", LlamaSpec(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, intermediate=176, block_size=32,
                                      n_expert=8, expert_top_k=2),
                     marks=pytest.mark.integration),
    ],
)
def test_model_config_applies_the_preset_and_overrides(name: str, expected: object) -> None:
    if name in ("llama", "moe"):
        pytest.importorskip("transformers")
    assert model_config(name, "tiny", n_layer=3, block_size=32) == expected


def test_the_default_model_has_an_untied_head_and_the_llama_of_small_is_the_default_llama() -> None:
    assert CompareConfig().model == model_config("gpt") and not model_config("gpt").tie_head
    assert LlamaSpec.of_shape(2, 4, 128, 64) == LlamaSpec()
    assert set(MODELS) == {"gpt", "gpt-tied", "llama", "moe"}


def test_llama_without_transformers_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(llama, "transformers_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'amp8\[hf\]'"):
        model_config("llama")
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--model", "llama", "--no-progress"])
    assert exit_.value.code == 2
    assert "transformers is not installed; install it with pip install 'amp8[hf]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "model", "recipe"),
    [
        ([], model_config("gpt"), None),
        (["--model", "gpt-tied", "--preset", "tiny"], PRESETS["tiny"], None),
        pytest.param(["--model", "llama", "--preset", "tiny"], LlamaSpec.of_shape(2, 4, 64, 64), None,
                     marks=[pytest.mark.integration,
                            pytest.mark.skipif(not llama.transformers_available(), reason="needs transformers")]),
        (["--n-embd", "64", "--recipe", "rowwise"], model_config("gpt", n_embd=64), amp8.Recipe.preset("rowwise")),
        (["--activations", "fp8"], model_config("gpt"), amp8.Recipe(activations="fp8")),
        (["--high-precision-layers", "head"], model_config("gpt"), amp8.Recipe(high_precision_layers=("head",))),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_compare_flags_choose_the_model_and_recipe(
    flags: list[str], model: object, recipe: amp8.Recipe | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --recipe (or a flag that changes one) the runs use initialize's default."""
    seen: list[CompareConfig] = []
    monkeypatch.setattr(runner, "compare", lambda config, **_: seen.append(config))
    assert main(["compare", *flags]) == 0
    assert seen[0].model == model and seen[0].recipe == recipe
