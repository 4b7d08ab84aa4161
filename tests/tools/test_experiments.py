"""The stdlib byte corpus, the GPT, and the compare runner on a tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

import amp8
from amp8.nn import Fp8Linear
from amp8.tools.cli import main
from amp8.tools.experiments.compare import (
    ABLATION, JSON_NAME, TORCHAO_RUNS, CompareConfig, CompareResult, RunResult, compare, load_report,
    missing_peer_note, run_specs,
)
from amp8.tools.experiments.corpus import (
    CorpusConfig, docs_documents, load_corpus, sample_batch, source_files, stdlib_root,
)
from amp8.tools.experiments.gpt import GPT, PRESETS, GPTConfig
from amp8.tools.experiments.paired import NULL, NULL_PERTURBATION
from amp8.tools.experiments.train import evaluate

TINY = CompareConfig(
    model=PRESETS["tiny"], steps=6, batch_size=4, eval_interval=3, eval_batches=2,
    train_loss_window=2, torchao=False, corpus=CorpusConfig(max_bytes=64 * 1024),
)


# -- corpus ------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_splits_whole_files() -> None:
    config = CorpusConfig(max_bytes=256 * 1024)
    first, second = load_corpus(config), load_corpus(config)
    assert first.sha256 == second.sha256
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert first.train.numel() + first.val.numel() == config.max_bytes
    assert first.val.numel() == config.max_bytes // config.holdout_every
    files = source_files(stdlib_root())
    assert files == sorted(files) and len(files) >= 10
    # The first validation file is the 10th by name; its bytes start the validation split.
    head = files[config.holdout_every - 1].read_bytes()[:256]
    assert bytes(first.val[: len(head)].tolist()) == head
    assert bytes(first.train[:256].tolist()) == files[0].read_bytes()[:256]


def test_docs_corpus_holds_out_whole_topics() -> None:
    from pydoc_data.topics import topics

    config = CorpusConfig(source="docs")
    first, second = load_corpus(config), load_corpus(config)
    assert first.sha256 == second.sha256 and first.describe()["corpus"] == "docs"
    documents = docs_documents(config)
    assert b"\n\n".join(text for name, text in documents if name.startswith("assert#")) == topics["assert"].encode()
    assert bytes(first.train[:256].tolist()) == documents[0][1][:256]
    assert bytes(first.val[:256].tolist()) == documents[config.holdout_every - 1][1][:256]
    assert first.val.numel() > 0.05 * (first.train.numel() + first.val.numel()), "a tenth of the pieces validate"
    assert first.sha256 != load_corpus(CorpusConfig(max_bytes=config.max_bytes)).sha256


@pytest.mark.parametrize(
    "changes, message",
    [({"source": "wiki"}, "CorpusConfig.source"), ({"source": "docs", "root": "."}, "CorpusConfig.root")],
)
def test_corpus_config_rejects_unknown_sources(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CorpusConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("field, value", [("max_bytes", 10), ("holdout_every", 1), ("max_bytes", True)])
def test_corpus_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"CorpusConfig.{field}"):
        CorpusConfig(**{field: value})


def test_corpus_needs_python_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="CorpusConfig"):
        load_corpus(CorpusConfig(root=str(tmp_path)))


def test_batches_follow_the_generator_and_shift_by_one() -> None:
    data = load_corpus(CorpusConfig(max_bytes=64 * 1024)).train
    x, y = sample_batch(data, 5, 32, torch.Generator().manual_seed(3))
    x2, y2 = sample_batch(data, 5, 32, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (5, 32) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="block_size"):
        sample_batch(data[:10], 1, 32, torch.Generator())


# -- GPT ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpt_shapes_and_loss(preset: str) -> None:
    config = PRESETS[preset]
    model = GPT(config, torch.Generator().manual_seed(0))
    idx, targets = torch.randint(0, 256, (2, 3, config.block_size))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, config.block_size, 256)
    # Near-uniform predictions at initialization: cross-entropy close to ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1, loss.item()
    assert model.head.weight is model.tok_emb.weight


def test_gpt_init_uses_only_its_generator() -> None:
    state = torch.random.get_rng_state()
    first = GPT(PRESETS["tiny"], torch.Generator().manual_seed(7))
    assert torch.equal(torch.random.get_rng_state(), state), "the global random state was touched"
    second = GPT(PRESETS["tiny"], torch.Generator().manual_seed(7))
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_gpt_is_causal() -> None:
    model = GPT(PRESETS["tiny"]).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    torch.testing.assert_close(model(idx)[0][:, :-1], model(changed)[0][:, :-1], atol=0, rtol=0)


def test_o1_swaps_every_projection_but_not_the_tied_head() -> None:
    model = GPT(PRESETS["tiny"])
    model, _ = amp8.initialize(model, None, "O1", recipe=amp8.Recipe())
    fp8 = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]
    assert len(fp8) == 4 * PRESETS["tiny"].n_layer and "head" not in fp8
    report = amp8.report(model)
    row = next(row for row in report.rows if row.name == "tok_emb.weight")
    assert "shared" in row.note


@pytest.mark.parametrize(
    "changes, message",
    [({"n_embd": 72, "n_head": 4}, "multiple of 16"), ({"n_embd": 64, "n_head": 5}, "divisible"),
     ({"n_layer": 0}, "n_layer")],
)
def test_gpt_config_rejects_bad_shapes(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**changes)


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match="'tiny'"):
        GPTConfig.from_preset("huge")


# -- compare -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [({"levels": ("O1",)}, "lacks 'O0'"), ({"levels": ("O0", "0O1")}, "not amp8 opt levels"),
     ({"steps": 0}, "steps"), ({"lr": -1.0}, "lr"), ({"lr": float("inf")}, "finite lr"),
     ({"weight_decay": -0.1}, "weight_decay"), ({"seed": -1}, r"seed=-1 .* \[0, 2\*\*63\)"),
     ({"device": "tpu9"}, "device='tpu9' is not a torch device")],
)
def test_compare_config_rejects_bad_values(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TINY.replace(**changes)


@pytest.mark.parametrize("field", ["model", "corpus", "recipe"])
def test_compare_config_rejects_wrong_types(field: str) -> None:
    with pytest.raises(TypeError, match=f"CompareConfig.{field} must be a"):
        TINY.replace(**{field: "small"})


def test_compare_refuses_what_is_not_a_config() -> None:
    from amp8.tools.experiments.compare import compare

    with pytest.raises(TypeError, match="compare takes an amp8.tools.experiments.compare.CompareConfig, got dict"):
        compare({"steps": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seeds", "expected"),
    [
        (1, [("O0", 5), ("O1", 5), ("O2", 5), ("O3", 5), (ABLATION, 5)]),
        (2, [("O0", 5), ("O1", 5), ("O2", 5), ("O3", 5), (ABLATION, 5), (NULL, 5),
             ("O0", 6), ("O1", 6), ("O2", 6), ("O3", 6), (NULL, 6)]),
    ],
)
def test_run_specs_pair_every_level_by_seed_and_ablate_once(seeds: int, expected: list[tuple[str, int]]) -> None:
    specs = run_specs(TINY.replace(seeds=seeds, seed=5))
    assert [(spec.name, spec.seed) for spec in specs] == expected
    null = [spec for spec in specs if spec.name == NULL]
    assert all(spec.level == "O0" and spec.init_perturbation == NULL_PERTURBATION for spec in null)


def test_runs_use_initialize_default_recipe_unless_one_is_given() -> None:
    specs = {spec.name: spec for spec in run_specs(TINY)}
    assert TINY.recipe is None and specs["O0"].recipe is None and specs["O2"].recipe is None
    assert specs[ABLATION].recipe == amp8.Recipe(scaling="none")


def test_recipe_reaches_the_fp8_runs_and_the_ablation() -> None:
    block = amp8.Recipe.preset("deepseek")
    specs = {spec.name: spec for spec in run_specs(TINY.replace(recipe=block))}
    assert specs["O2"].recipe == block
    assert specs[ABLATION].recipe == block.replace(scaling="none")


def test_fp8_activations_reach_the_fp8_runs_but_not_the_baseline() -> None:
    recipe = amp8.Recipe(activations="fp8")
    specs = {spec.name: spec for spec in run_specs(TINY.replace(recipe=recipe))}
    assert specs["O1"].recipe == recipe and specs[ABLATION].recipe.activations is amp8.config.ActivationFormat.FP8
    assert specs["O0"].recipe.activations is amp8.config.ActivationFormat.HIGH


def test_learning_rate_warms_up_then_decays() -> None:
    config = TINY.replace(steps=100, warmup_steps=10)
    rates = [config.lr_at(step) for step in range(100)]
    assert rates[9] == pytest.approx(config.lr)
    assert rates[0] < rates[9] and rates[-1] == pytest.approx(config.lr * config.min_lr_ratio)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Eleven short training runs: the tests that take this are marked slow."""
    out = tmp_path_factory.mktemp("compare")
    console = Console(record=True, width=200)
    # the recipe these assertions were written for: one scale per tensor, the head in FP8
    compare(TINY.replace(seeds=2, recipe=amp8.Recipe()), out_dir=out, console=console, progress=False)
    return out, console.export_text()


@pytest.mark.slow
def test_compare_writes_json_with_every_curve(tiny_run: tuple[Path, str]) -> None:
    out, _ = tiny_run
    data = json.loads((out / JSON_NAME).read_text())
    assert set(data) == {"config", "corpus", "environment", "runs", "o0_seed_spread", "paired", "recommended"}
    assert data["recommended"]["level"] in TINY.levels and data["recommended"]["threshold_percent"] == 0.5
    assert [(run["name"], run["seed"]) for run in data["runs"]] == [
        ("O0", 0), ("O1", 0), ("O2", 0), ("O3", 0), (ABLATION, 0), (NULL, 0),
        ("O0", 1), ("O1", 1), ("O2", 1), ("O3", 1), (NULL, 1)]
    seeds = {(run["name"], run["seed"]): run for run in data["runs"]}
    runs = {name: seeds[name, 0] for name, _ in seeds}  # the first seed's
    for name, seed in (("O0", 0), ("O1", 0), (ABLATION, 0), ("O0", 1), (NULL, 1)):
        run = seeds[name, seed]
        assert run["status"] == "ok", run["reason"]
        assert len(run["train_curve"]) == TINY.steps
        assert [step for step, _ in run["val_curve"]] == [3, 6]
        for key in ("final_train_loss", "final_val_loss", "tokens_per_s", "bytes_per_param", "fp8_share",
                    "activation_bytes_per_token"):
            assert run[key] > 0 or (key == "fp8_share" and name.startswith("O0")), (name, key)
        assert run["report"]["rows"] and run["highlights"]
        base = seeds["O0", seed]["final_val_loss"]
        assert run["gap_percent"] == pytest.approx(100 * (run["final_val_loss"] - base) / base, abs=1e-12), (name, seed)
    assert runs["O0"]["gap_percent"] == 0 and runs["O0"]["skipped_steps"] is None
    assert runs["O1"]["skipped_steps"] == 0 and runs["O1"]["recipe"]["scaling"] == "current"
    assert runs[ABLATION]["recipe"]["scaling"] == "none"
    assert runs["O1"]["bytes_per_param"] < runs["O0"]["bytes_per_param"]
    # O1's FP8 layers keep their input in FP8: fewer bytes saved per token than FP32 O0.
    assert runs["O1"]["activation_bytes_per_token"] < runs["O0"]["activation_bytes_per_token"]
    spread = data["o0_seed_spread"]
    assert spread["seeds"] == 2 and spread["spread"] >= 0
    paired = data["paired"]
    assert paired["seeds"] == [0, 1] and set(paired["gaps"]) == {"O1", "O2", "O3", NULL}
    for name, row in paired["gaps"].items():  # each seed's gap, to O0 from that seed
        assert row["gaps_percent"] == [seeds[name, seed]["gap_percent"] for seed in (0, 1)], name
        assert row["mean_gap_percent"] == pytest.approx(sum(row["gaps_percent"]) / 2, abs=1e-12), name
        assert row["stderr_percent"] == pytest.approx(abs(row["gaps_percent"][0] - row["gaps_percent"][1]) / 2,
                                                      abs=1e-12), name
    assert data["corpus"]["sha256"] == load_corpus(TINY.corpus).sha256


@pytest.mark.slow
def test_unavailable_levels_are_recorded_and_printed(tiny_run: tuple[Path, str]) -> None:
    out, text = tiny_run
    runs = {run["name"]: run for run in json.loads((out / JSON_NAME).read_text())["runs"]}
    for level in ("O2", "O3"):
        if runs[level]["status"] == "ok":
            continue  # the level trains in this build
        assert runs[level]["status"] == "unavailable" and runs[level]["train_curve"] == []
        assert f"{level} skipped: {runs[level]['reason']}" in text


@pytest.mark.slow
def test_compare_prints_the_table(tiny_run: tuple[Path, str]) -> None:
    _, text = tiny_run
    for header in ("run", "train loss", "val loss", "gap to O0", "tokens/s", "peak mem", "bytes/param",
                   "act bytes/token", "skipped"):
        assert header in text, header
    assert "O0 seed spread over 2 seeds" in text
    assert "O1: FP8:" in text
    paired = json.loads((tiny_run[0] / JSON_NAME).read_text())["paired"]["gaps"]
    o1 = paired["O1"]
    assert f"{round(o1['mean_gap_percent'], 2) + 0.0:+.2f} ± {o1['stderr_percent']:.2f}%" in text
    null = paired[NULL]
    assert f"noise floor: {NULL} (O0 from initial weights perturbed by 1e-06 relative) ends " \
           f"{round(null['mean_gap_percent'], 2) + 0.0:+.2f} ± {null['stderr_percent']:.2f}% from O0 over 2 seeds" \
           in " ".join(text.split())


@pytest.mark.slow
def test_compare_plots_or_says_how(tiny_run: tuple[Path, str]) -> None:
    out, text = tiny_run
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert "pip install 'amp8[plot]'" in text
    else:
        assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_command_prints_a_run(tiny_run: tuple[Path, str], capsys: pytest.CaptureFixture) -> None:
    out, _ = tiny_run
    assert main(["report", "--run", str(out), "--level", ABLATION]) == 0
    text = capsys.readouterr().out
    assert "amp8 precision report" in text and "underflow" in text
    assert load_report(out, "O1").fp8_share > 0.5
    assert main(["report", "--run", str(out), "--level", "O7"]) == 2
    assert "choose one of O0, O1" in capsys.readouterr().out
    runs = json.loads((out / JSON_NAME).read_text())["runs"]
    first_o1 = next(run for run in runs if run["name"] == "O1")
    assert first_o1["seed"] == 0 and load_report(out, "O1").to_dict() == first_o1["report"]
    pytest.importorskip("matplotlib")
    png = out / "report.png"
    assert main(["report", "--run", str(out), "--level", "O1", "--full", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out


def test_report_command_without_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", "--run", str(tmp_path)]) == 2
    assert "amp8 compare --out" in capsys.readouterr().out


def test_compare_command_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["compare", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--levels", "O0", "O1",
            "--no-ablation", "--no-torchao", "--max-bytes", "65536", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert [run["name"] for run in data["runs"]] == ["O0", "O1"]
    assert data["config"]["model"]["n_embd"] == PRESETS["tiny"].n_embd


def test_compare_command_keeps_the_named_layers_in_high_precision(tmp_path: Path) -> None:
    argv = ["compare", "--preset", "tiny", "--steps", "1", "--batch-size", "2", "--levels", "O0", "O1",
            "--no-ablation", "--no-torchao", "--max-bytes", "65536", "--out", str(tmp_path), "--no-progress",
            "--recipe", "nvfp4", "--high-precision-layers", "blocks.1.*", "head"]
    assert main(argv) == 0
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["config"]["recipe"]["high_precision_layers"] == ["blocks.1.*", "head"]
    rows = {row["name"]: row for row in data["runs"][1]["report"]["rows"]}
    assert rows["blocks.0.mlp.fc.weight"]["fp8"] and not rows["blocks.1.mlp.fc.weight"]["fp8"]
    assert rows["blocks.1.mlp.fc.weight"]["note"] == "matches Recipe.high_precision_layers pattern 'blocks.1.*'"


@pytest.mark.integration
def test_compare_command_trains_the_llama_with_its_head_in_fp8(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["compare", "--model", "llama", "--preset", "tiny", "--steps", "1", "--batch-size", "2", "--levels",
            "O0", "O1", "--no-ablation", "--no-torchao", "--max-bytes", "65536", "--out", str(tmp_path),
            "--no-progress", "--recipe", "tensorwise"]
    assert main(argv) == 0
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["config"]["model"]["intermediate"] == 176 and not data["config"]["model"]["tie_head"]
    rows = {row["name"]: row for row in data["runs"][1]["report"]["rows"]}
    assert rows["lm.lm_head.weight"]["fp8"], "an untied head is an FP8 layer like any other"


@pytest.mark.integration
def test_compare_command_trains_the_mixtral_with_its_experts_in_fp8(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["compare", "--model", "moe", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--levels",
            "O0", "O1", "--no-ablation", "--no-torchao", "--max-bytes", "65536", "--out", str(tmp_path),
            "--no-progress"]
    assert main(argv) == 0
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["config"]["model"]["n_expert"] == 8 and data["config"]["model"]["expert_top_k"] == 2
    o0, o1 = data["runs"][0], data["runs"][1]
    assert o1["final_train_loss"] == pytest.approx(o0["final_train_loss"], rel=0.02)
    rows = {row["name"]: row for row in o1["report"]["rows"]}
    experts = [name for name in rows if ".experts." in name]
    assert len(experts) == 4 and all(rows[name]["layer"] == "Fp8Experts" for name in experts)
    assert all("GEMMs in FP8" in rows[name]["note"] for name in experts)
    assert not rows["lm.model.layers.0.mlp.gate.weight"]["fp8"], "the router stays in high precision"


def test_compare_command_takes_the_corpus_and_schedule(tmp_path: Path) -> None:
    argv = ["compare", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--levels", "O0",
            "--no-ablation", "--no-torchao", "--corpus", "docs", "--warmup-steps", "0", "--weight-decay", "0",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["corpus"]["corpus"] == "docs"
    assert (data["config"]["warmup_steps"], data["config"]["weight_decay"]) == (0, 0.0)


def test_torchao_peer_runs_only_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    from amp8.tools.experiments import compare as runner

    monkeypatch.setattr(runner, "torchao_available", lambda: False)
    assert "torchao" not in [spec.name for spec in run_specs(TINY.replace(torchao=True))]
    monkeypatch.setattr(runner, "torchao_available", lambda: True)
    assert [spec.name for spec in run_specs(TINY.replace(torchao=True))][-2:] == list(TORCHAO_RUNS.values())
    assert "torchao" not in [spec.name for spec in run_specs(TINY.replace(torchao=False))]


@pytest.mark.parametrize(("installed", "asked", "said"), [(False, True, True), (True, True, False), (False, False, False)])
def test_a_missing_torchao_peer_is_said_once(
    installed: bool, asked: bool, said: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from amp8.tools.experiments import compare as runner

    monkeypatch.setattr(runner, "torchao_available", lambda: installed)
    note = missing_peer_note(TINY.replace(torchao=asked))
    assert (note is not None) is said
    if said:
        assert note.startswith("torchao is not installed") and "pip install torchao" in note


@pytest.mark.parametrize("width", [80, 160])
def test_compare_table_headers_fold_instead_of_being_cut(width: int) -> None:
    run = RunResult("O0", "O0", 0, final_train_loss=2.5, final_val_loss=2.6, tokens_per_s=12345.0,
                    bytes_per_param=16.0, fp8_share=0.0)
    console = Console(record=True, width=width)
    console.print(CompareResult(TINY, [run], {}, {}).table())
    text = console.export_text()
    assert "…" not in text, text
    headers = _header_cells(text)
    for header in ("run", "train loss", "val loss", "gap to O0", "tokens/s", "peak mem", "bytes/param",
                   "FP8 share", "skipped"):
        assert header.replace(" ", "") in headers, f"{header!r} is not whole in\n{text}"


def _header_cells(text: str) -> list[str]:
    """Each header cell of a rich table, its folded lines joined and spaces dropped."""
    columns: dict[int, str] = {}
    for line in text.splitlines():
        for index, cell in enumerate(line.split("┃")[1:-1]):
            columns[index] = columns.get(index, "") + cell.replace(" ", "")
    return list(columns.values())


# -- paired runs ---------------------------------------------------------------------------
@pytest.mark.slow
def test_paired_runs_pair_each_level_with_o0_by_seed() -> None:
    from amp8.tools.experiments.paired import Variant, paired_runs

    result = paired_runs(TINY, [Variant("O1", "O1")], seeds=(0, 1))
    assert set(result.losses) == {"O0", "O1"} and all(len(v) == 2 for v in result.losses.values())
    expected = [100 * (l1 - l0) / l0 for l1, l0 in zip(result.losses["O1"], result.losses["O0"])]
    assert result.gaps_percent("O1") == pytest.approx(expected, rel=0, abs=0)
    assert result.mean_gap_percent("O1") == pytest.approx(sum(expected) / 2, rel=1e-12)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["mean_gap_percent"]["O1"] == pytest.approx(result.mean_gap_percent("O1"), rel=1e-12)
    # O0 is deterministic: the same seed trains to the same loss, so a kept baseline pairs.
    again = paired_runs(TINY, [Variant("O1", "O1")], seeds=(1,), baseline=result.losses["O0"][1:])
    assert again.losses["O1"] == result.losses["O1"][1:]


@pytest.mark.parametrize(
    "variants, seeds, baseline",
    [(["O0"], (0,), None), (["O1", "O1"], (0,), None), (["O1"], (), None), (["O1"], (0, 1), [1.0])],
)
def test_paired_runs_reject_bad_requests(variants: list[str], seeds: tuple[int, ...], baseline: list[float] | None) -> None:
    from amp8.tools.experiments.paired import Variant, paired_runs

    with pytest.raises(ValueError, match="seed|variants|baseline"):
        paired_runs(TINY, [Variant(name, "O1") for name in variants], seeds, baseline=baseline)


def test_the_held_out_loss_is_measured_without_autograd() -> None:
    """``evaluate`` runs the model under no_grad (no graph kept per batch) in eval mode,
    and gives train mode back."""
    modes = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((), 2.0))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
            modes.append((torch.is_grad_enabled(), self.training))
            return None, (self.weight * x - y).square().mean()

    model = Probe()
    batches = [(torch.ones(3), torch.zeros(3)), (torch.ones(3), torch.ones(3))]
    assert evaluate(model, batches) == (4.0 + 1.0) / 2
    assert modes == [(False, False), (False, False)] and model.training
