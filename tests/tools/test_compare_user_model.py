"""``amp8.compare(model=..., data=...)`` and ``amp8 compare --model module:name``: the
comparison of opt levels on the user's own model, data, optimizer and loss, its
recommendation, and what it says about bad input. The models (a ViT, a BERT-style
classifier, an MLP regression) are in ``compare_user_models.py``; each run is a few
steps of a model of about 20k parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import amp8
import compare_user_models as user
from amp8.tools.cli import main
from amp8.tools.experiments.compare import CompareConfig, CompareResult, RunResult
from amp8.tools.experiments.compare_config import JSON_NAME, PNG_NAME
from amp8.tools.experiments.paired import NULL
from amp8.tools.experiments.recommend import trouble_tensors
from amp8.tools.experiments.user_config import UserCompareConfig
from amp8.tools.experiments.user_batches import count_items, fresh_pass, steps_of

LEVELS = ("O0", "O1", "O2", "O3")
MODULE = Path(user.__file__)
STEPS = 4


def _objects(name: str) -> dict[str, Any]:
    build, data, eval_data, loss = user.USER_MODELS[name]
    return {"model": getattr(user, build), "data": getattr(user, data), "eval_data": getattr(user, eval_data),
            "loss": None if loss is None else getattr(user, loss)}


def _compare(out_dir: Path | None = None, **kwargs: Any) -> tuple[CompareResult, str]:
    console = Console(record=True, width=250)
    kwargs = {"steps": STEPS, "optimizer": user.adamw, **kwargs}
    result = amp8.compare(out_dir=out_dir, console=console, progress=False, plot=out_dir is not None, **kwargs)
    return result, " ".join(console.export_text().split())


@pytest.fixture(scope="module", params=list(user.USER_MODELS))
def user_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, CompareResult, str]:
    """Each model through the Python API at O0-O3, with validation data, JSON and PNG."""
    out = tmp_path_factory.mktemp(request.param)
    result, text = _compare(out, **_objects(request.param))
    return request.param, out, result, text


def test_each_user_model_trains_at_every_level_with_a_recommendation(user_run: tuple[str, Path, CompareResult, str]) -> None:
    name, out, result, text = user_run
    assert [(run.name, run.status) for run in result.runs] == [(level, "ok") for level in LEVELS], name
    for run in result.runs:
        assert len(run.train_curve) == STEPS and [step for step, _ in run.val_curve] == [1, 2, 3, 4], run.name  # a fifth
        assert run.samples_per_s and run.samples_per_s > 0 and run.train_s and run.train_s > 0
        assert run.report_summary and run.batches_differ_at is None, run.name
    assert result.run("O2").bytes_per_param < result.run("O0").bytes_per_param
    assert result.run("O1").fp8_share > 0.5 and result.run("O0").fp8_share == 0
    recommended = result.recommended
    assert recommended.level in LEVELS and "not a promise" in recommended.reason
    assert f"recommended: {recommended.level}:" in text
    for header in ("train loss", "val loss", "gap to O0", "bytes/param", "FP8 share"):
        assert header in text, header
    assert ("tokens/s" if name == "bert" else "samples/s") in text  # the BERT batches hold input_ids
    assert f"O2: {result.run('O2').report_summary}" in text
    data = json.loads((out / JSON_NAME).read_text())
    assert [run["name"] for run in data["runs"]] == list(LEVELS)
    assert data["recommended"]["level"] == recommended.level and data["config"]["steps"] == STEPS
    assert data["corpus"]["parameters"] == sum(p.numel() for p in getattr(user, user.USER_MODELS[name][0])().parameters())
    assert (out / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", list(user.USER_MODELS))
def test_each_user_model_runs_from_the_command_line(name: str, tmp_path: Path) -> None:
    build, data, eval_data, loss = user.USER_MODELS[name]
    argv = ["compare", "--model", f"{MODULE}:{build}", "--data", f"{MODULE}:{data}", "--eval-data",
            f"{MODULE}:{eval_data}", "--optimizer", f"{MODULE}:adamw", "--steps", "2", "--out", str(tmp_path),
            "--no-progress", *(["--loss", f"{MODULE}:{loss}"] if loss else [])]
    assert main(argv) == 0
    result = json.loads((tmp_path / JSON_NAME).read_text())
    assert [(run["name"], run["status"]) for run in result["runs"]] == [(level, "ok") for level in LEVELS]
    assert result["recommended"]["level"] in LEVELS
    assert result["corpus"]["model"] == {"vit": "TinyViT", "bert": "TinyBert", "mlp-mse": "Sequential"}[name]
    assert (tmp_path / PNG_NAME).is_file()


def test_a_module_is_copied_for_every_run_and_never_trained() -> None:
    model = user.build_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    result, _ = _compare(model=model, data=user.mlp_data, loss=user.mse_loss, levels=("O0", "O1"))
    assert all(run.ok for run in result.runs)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the user's module was trained"
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear)), "the user's module was swapped"


class Counting:
    """A model factory and a loss that count their calls, and data that counts passes."""

    def __init__(self) -> None:
        self.builds, self.losses, self.passes = 0, 0, 0

    def build(self) -> nn.Module:
        self.builds += 1
        return user.build_mlp()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.losses += 1
        return user.mse_loss(model, batch)

    def data(self) -> list[Any]:
        self.passes += 1
        return user.mlp_data


@pytest.mark.parametrize("seeds", [1, 2])
def test_one_model_per_seed_and_no_work_beyond_the_steps(seeds: int) -> None:
    """The structural side of the overhead target: per run exactly ``steps`` losses (one
    forward each) and one pass over the data; evaluations add one loss per eval batch;
    one model built per seed. bench/compare_overhead.py measures the time."""
    counting = Counting()
    levels = ("O0", "O1")
    result, _ = _compare(model=counting.build, data=counting.data, loss=counting.loss, steps=STEPS, levels=levels,
                         seeds=seeds, eval_data=user.mlp_eval, eval_interval=2)
    runs = len(levels) + (1 if seeds > 1 else 0)  # the null variant with several seeds
    assert [run.name for run in result.runs] == [*levels, *([NULL] if seeds > 1 else [])] * seeds
    evaluations = STEPS // 2
    assert counting.builds == seeds
    assert counting.passes == runs * seeds
    assert counting.losses == runs * seeds * (STEPS + evaluations * len(user.mlp_eval))


def test_shuffled_data_loader_gives_every_level_the_same_batches() -> None:
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
    state = torch.get_rng_state()
    result, _ = _compare(model=user.build_mlp, data=loader, loss=user.mse_loss, steps=None, levels=("O0", "O1"),
                         seeds=2)
    assert torch.equal(torch.get_rng_state(), state), "the caller's generator moved"
    assert all(run.ok and len(run.train_curve) == len(loader) for run in result.runs)
    assert [run.batches_differ_at for run in result.runs] == [None] * len(result.runs)


def test_batches_that_change_between_passes_are_reported() -> None:
    import random

    def data() -> list[tuple[torch.Tensor, torch.Tensor]]:  # seeded by Python's random, which compare leaves alone
        x = torch.full((8, 16), random.random())
        return [(x, x[:, :1])] * 2

    result, text = _compare(model=user.build_mlp, data=data, loss=user.mse_loss, steps=2, levels=("O0", "O1"))
    assert result.run("O1").batches_differ_at == 0
    assert "O1 saw other batches than O0 from step 0" in text


class FailsInFp8(nn.Module):
    """A model whose forward needs its layer to be a plain nn.Linear (as a custom kernel might)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.fc) is not nn.Linear:
            raise RuntimeError("fused kernel needs an nn.Linear")
        return self.fc(x)


def test_a_level_that_fails_is_reported_and_the_others_complete(tmp_path: Path) -> None:
    result, text = _compare(tmp_path, model=FailsInFp8, data=user.mlp_data,
                            loss=lambda model, batch: model(batch[0]).pow(2).mean())
    assert [(run.name, run.status) for run in result.runs] == [("O0", "ok")] + [(lvl, "failed") for lvl in LEVELS[1:]]
    assert result.run("O1").reason == "RuntimeError at step 0: fused kernel needs an nn.Linear"
    assert "O1 failed: RuntimeError at step 0: fused kernel needs an nn.Linear" in text
    assert result.recommended.level == "O0" and "O1 failed (RuntimeError at step 0" in result.recommended.reason
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert data["runs"][0]["status"] == "ok" and len(data["runs"][0]["train_curve"]) == STEPS
    assert (tmp_path / PNG_NAME).is_file()


def _generator() -> Any:
    yield from user.mlp_data


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"loss": lambda model, batch: F.mse_loss(model(batch[0]), batch[1], reduction="none")}, ValueError,
         r"is a tensor of shape \(8, 1\), not a scalar loss; reduce it"),
        ({"loss": lambda model, batch: 1.0}, TypeError, "is a float, not a scalar loss tensor"),
        ({"loss": None, "data": [torch.randn(8, 16)]}, ValueError,
         r"the model's output \(no loss= given\) is a tensor of shape \(8, 1\)"),
        ({"loss": lambda model, batch: torch.tensor(1.0)}, ValueError, "does not depend on any trainable parameter"),
        ({"data": []}, ValueError, r"data holds no batches \(len 0\)"),
        ({"data": lambda: [], "steps": 2}, ValueError, "data yielded no batches"),
        ({"data": _generator()}, TypeError, "data is an iterator .generator., which can be read only once"),
        ({"eval_data": iter(user.mlp_eval)}, TypeError, "eval_data is an iterator"),
        ({"data": 3}, TypeError, "data must be a re-iterable of batches"),
        ({"model": lambda: "mlp"}, TypeError, "returned a str, not an nn.Module"),
        ({"model": 3}, TypeError, "model must be an nn.Module or a function"),
        ({"optimizer": lambda params: "adam"}, TypeError, "returned a str, not a torch.optim.Optimizer"),
        ({"levels": ("O1",)}, ValueError, "lacks 'O0'"),
        ({"levels": ("O0", "O4")}, ValueError, "'O4', not amp8 opt levels"),
        ({"steps": 0}, ValueError, "steps=0 is not valid"),
        ({"threshold_percent": -1}, ValueError, "threshold_percent=-1 is not valid"),
        ({"colour": "red"}, TypeError, "unknown option.s. colour; the options are model, data"),
        ({"model": nn.Linear(16, 1), "data": None}, TypeError, "needs both model= .* and data="),
    ],
    ids=lambda value: None if isinstance(value, dict) else str(value)[:40],
)
def test_bad_input_fails_before_training_with_a_message_that_names_it(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    kwargs = {"model": user.build_mlp, "data": user.mlp_data, "loss": user.mse_loss, "levels": ("O0", "O1"), **changes}
    with pytest.raises(error, match=message):
        _compare(**kwargs)


def test_a_model_that_fails_at_o0_stops_the_comparison() -> None:
    def broken(model: nn.Module, batch: Any) -> torch.Tensor:
        return model(batch[0][:, :3]).mean()  # a shape error in the user's code

    with pytest.raises(RuntimeError, match=r"O0 \(your model as it is, no FP8\) failed RuntimeError at step 0: "):
        _compare(model=user.build_mlp, data=user.mlp_data, loss=broken, levels=("O0", "O1"))


def test_default_loss_reads_the_output_loss_or_a_scalar() -> None:
    scalar = nn.Sequential(nn.Linear(16, 16), nn.Flatten(0))
    data = [torch.randn(1, 16)] * 2

    class ToScalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).pow(2).mean()

    result, _ = _compare(model=ToScalar, data=data, levels=("O0",))
    assert result.run("O0").ok and result.recommended.level == "O0"
    assert "no FP8 level was trained" in result.recommended.reason
    with pytest.raises(ValueError, match="not a scalar loss"):
        _compare(model=lambda: scalar, data=data, levels=("O0",))


def test_steps_cycle_the_data_and_count_items() -> None:
    assert [batch for batch in steps_of([1, 2, 3], 7)] == [1, 2, 3, 1, 2, 3, 1]
    assert list(fresh_pass(lambda: [4, 5])) == [4, 5]
    assert count_items(user.bert_data[0]) == (user.BATCH, user.BATCH * 16)
    assert count_items(user.vit_data[0]) == (user.BATCH, None)
    assert count_items({"x": [torch.zeros(3, 2)]}) == (3, None)


def test_builtin_form_unchanged_and_overridable(monkeypatch: pytest.MonkeyPatch) -> None:
    from amp8.tools.experiments import compare as runner

    seen: list[CompareConfig] = []
    monkeypatch.setattr(runner, "compare_builtin", lambda config, **_: seen.append(config))
    amp8.compare(progress=False)
    amp8.compare(CompareConfig(steps=7), levels=("O0", "O1"), threshold_percent=0.2)
    assert seen[0] == CompareConfig()
    assert seen[1] == CompareConfig(steps=7, levels=("O0", "O1"), threshold_percent=0.2)
    with pytest.raises(TypeError, match=r"amp8.compare\(model=..., data=...\)"):
        amp8.compare(user.build_mlp)
    with pytest.raises(TypeError, match="not both"):
        amp8.compare(CompareConfig(), model=user.build_mlp, data=user.mlp_data)
    with pytest.raises(TypeError, match="loss without data="):
        amp8.compare(loss=user.mse_loss)


# -- the recommendation, on results built by hand ----------------------------------------
def _run(name: str, seed: int, loss: float, bytes_per_param: float, status: str = "ok",
         rows: list[dict[str, Any]] | None = None) -> RunResult:
    return RunResult(name, name if name != NULL else "O0", seed, status=status, final_train_loss=loss,
                     final_val_loss=loss, train_curve=[loss], val_curve=[[1, loss]], bytes_per_param=bytes_per_param,
                     report={"rows": rows or []}, reason=None if status == "ok" else "boom")


BYTES = {"O0": 16.0, "O1": 11.0, "O2": 6.0, "O3": 7.0}


def _hand_result(losses: dict[str, list[float]], threshold: float = 0.5, status: dict[str, str] | None = None,
                 rows: list[dict[str, Any]] | None = None) -> CompareResult:
    seeds = len(losses["O0"])
    config = UserCompareConfig(model=user.build_mlp, data=user.mlp_data, steps=10, seeds=seeds,
                               threshold_percent=threshold, eval_data=user.mlp_eval)
    runs = [_run(name, seed, values[seed], BYTES.get(name, 16.0), (status or {}).get(name, "ok"), rows)
            for seed in range(seeds) for name, values in losses.items()]
    return CompareResult(config, runs, {}, {})


@pytest.mark.parametrize(
    ("losses", "threshold", "status", "level", "reason"),
    [
        ({"O0": [2.0], "O1": [2.001], "O2": [2.004], "O3": [2.002]}, 0.5, None, "O2", "stores 6.00 bytes/param"),
        ({"O0": [2.0], "O1": [2.001], "O2": [2.02], "O3": [2.002]}, 0.5, None, "O3", "O2 ended +1.00% from O0"),
        ({"O0": [2.0], "O1": [2.001], "O2": [2.004], "O3": [2.003]}, 0.1, None, "O1", "O2 ended +0.20%"),
        ({"O0": [2.0], "O1": [2.001], "O2": [2.001], "O3": [2.001]}, 0.5, {"O2": "failed"}, "O3", "O2 failed (boom)"),
        ({"O0": [2.0], "O1": [2.1], "O2": [2.1], "O3": [2.1]}, 0.5, None, "O0", "no FP8 level qualified"),
        ({"O0": [2.0], "O1": [1.9], "O2": [float("nan")], "O3": [2.5]}, 0.5, None, "O1", "not finite"),
        ({"O0": [2.0, 2.0, 2.0], "O1": [2.014, 2.02, 2.026], "O2": [2.0, 2.04, 2.08], "O3": [2.1, 2.1, 2.1],
          NULL: [2.0, 2.0, 2.0]}, 0.5, None, "O2", "within the noise floor"),
        ({"O0": [2.0], "O1": [2.0]}, 0.5, {"O0": "failed"}, None, "O0 did not train"),
    ],
)
def test_recommendation_picks_the_fewest_bytes_within_the_threshold_or_the_noise(
    losses: dict[str, list[float]], threshold: float, status: dict[str, str] | None, level: str | None, reason: str
) -> None:
    recommended = _hand_result(losses, threshold, status).recommended
    assert recommended.level == level, recommended.reason
    assert reason in recommended.reason
    assert recommended.reason.endswith("seed.") or recommended.reason.endswith("seeds.")


def test_no_qualifying_level_names_the_tensors_in_trouble() -> None:
    rows = [{"name": "head.weight", "fp8": True, "underflow": 0.25, "saturated": 0.0},
            {"name": "fc.weight", "fp8": True, "underflow": 0.001, "saturated": 0.03},
            {"name": "norm.weight", "fp8": False, "underflow": None, "saturated": None}]
    assert trouble_tensors({"rows": rows}) == ["head.weight underflow 25%", "fc.weight saturation 3%"]
    recommended = _hand_result({"O0": [2.0], "O1": [2.1]}, rows=rows).recommended
    assert recommended.level == "O0"
    assert "O1 ended +5.00% from O0, over the 0.5% threshold; its report shows head.weight underflow 25%" \
        in recommended.reason


@pytest.mark.integration
def test_hf_config_builds_a_causal_lm_from_a_local_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 400)
    out = tmp_path / "out"
    argv = ["compare", "--hf-config", str(tmp_path / "tiny"), "--data", str(text), "--steps", "2", "--batch-size",
            "2", "--block-size", "16", "--levels", "O0", "O1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / JSON_NAME).read_text())
    assert [(run["name"], run["status"]) for run in data["runs"]] == [("O0", "ok"), ("O1", "ok")]
    assert data["runs"][1]["tokens_per_s"] > 0 and data["config"]["model"] == f"LlamaConfig from {tmp_path / 'tiny'}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "bert"], "argument --model: invalid choice: 'bert'"),
        (["--data", "x:y"], "--data with --model 'gpt'"),
        (["--model", f"{MODULE}:build_mlp"], "your own model needs --data"),
        (["--model", "no_such_module_amp8:build", "--data", "x:y"], "cannot import 'no_such_module_amp8'"),
        (["--model", f"{MODULE}:nothing", "--data", f"{MODULE}:mlp_data"], "has no attribute 'nothing'"),
        (["--model", f"{MODULE}:build_mlp", "--data", f"{MODULE}:build_mlp"],
         "data() returned a Sequential, not an iterable of batches"),
        pytest.param(["--hf-config", "no-such-model-type", "--data", "a.txt"], "neither a local config",
                     marks=pytest.mark.integration),
    ],
)
def test_bad_user_flags_fail_with_a_clear_message(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                                  tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["compare", *argv, "--steps", "2", "--no-progress", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
