"""bench/gpt.py: every run's step and phases on the CPU, a failed compile recorded, the
ratios and the presets' shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench_checks import assert_record, no_compiler
from conftest import load_bench

gpt = load_bench("gpt")


@pytest.mark.slow
@pytest.mark.integration  # torchao's float8 where it is installed
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_gpt_eager_writes_every_run_with_its_optimizer_share(tmp_path: Path, preset: str) -> None:
    if preset.startswith("llama"):
        pytest.importorskip("transformers", reason="the Llama presets need transformers (pip install 'amp8[hf]')")
    path = gpt.main(["--preset", preset, "--steps", "2", "--warmup", "1", "--batch-size", "2",
                     "--device", "cpu", "--modes", "eager", "--out", str(tmp_path)])
    assert path.name == ("gpt-cpu.json" if preset == "tiny" else f"gpt-{preset}-cpu.json")
    record = assert_record(path, path.stem.removesuffix("-cpu"))
    assert record["preset"] == preset and record["parameters"] > 0 and record["tokens_per_step"] == 2 * 64
    assert set(record["runs"]) == set(gpt.RUNS)
    for name in ("baseline", "amp8 O1", "amp8 O2", "amp8 O3"):
        run = record["runs"][name]["eager"]
        assert run["mode"] == "eager", run
        assert run["step_ms"] > 0 and run["tokens_per_s"] > 0 and run["vs_baseline"] > 0, run
        assert run["forward_backward_ms"] > 0 and run["optimizer_ms"] > 0, run
        # The two phases are timed inside the step: together they cannot outlast it.
        assert run["forward_backward_ms"] + run["optimizer_ms"] <= run["step_ms"] * 1.01, run
        assert 0 < run["optimizer_share"] < 1, run
        assert run["final_loss"] == pytest.approx(5.55, abs=0.1), run  # ln 256 at the start
    torchao_run = record["runs"]["torchao"]["eager"]
    assert "error" not in torchao_run and ("skipped" in torchao_run or "step_ms" in torchao_run), torchao_run


@pytest.mark.slow
def test_gpt_records_a_failed_compile_and_the_eager_row_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", no_compiler)
    config = gpt.PRESETS["tiny"]
    device = torch.device("cpu")
    batches = gpt.make_batches(config, 2, 2, device)
    compiled = gpt.run_one("amp8 O1", "compiled", config, batches, 1, device, "blocks", None)
    assert "compiler unavailable" in compiled["error"] and "step_ms" not in compiled, compiled
    eager = gpt.run_one("amp8 O1", "eager", config, batches, 1, device, "blocks", None)
    assert eager["mode"] == "eager" and eager["step_ms"] > 0, eager


def test_gpt_ratios_compare_each_mode_with_its_own_baseline() -> None:
    rows = {"baseline": {"step_ms": 10.0, "forward_backward_ms": 8.0},
            "amp8 O1": {"step_ms": 20.0, "forward_backward_ms": 4.0}, "torchao": {"skipped": "unavailable"}}
    gpt.add_ratios(rows, tokens_per_step=1000)
    assert rows["baseline"]["tokens_per_s"] == pytest.approx(1e5) and rows["baseline"]["vs_baseline"] == 1.0
    assert rows["amp8 O1"]["vs_baseline"] == pytest.approx(0.5)
    assert rows["amp8 O1"]["forward_backward_vs_baseline"] == pytest.approx(2.0)
    assert rows["torchao"] == {"skipped": "unavailable"}


@pytest.mark.integration
def test_llama3_8b_layers_preset_has_llama3_8b_layer_shapes() -> None:
    pytest.importorskip("transformers", reason="the Llama presets need transformers (pip install 'amp8[hf]')")
    with torch.device("meta"):
        model = gpt.PRESETS["llama3-8b-layers"].build()
    blocks = gpt.transformer_blocks(model)
    shapes = {name.split(".")[-1]: tuple(module.weight.shape) for name, module in blocks[0].named_modules()
              if isinstance(module, torch.nn.Linear)}
    assert shapes == {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096),
                      "o_proj": (4096, 4096), "gate_proj": (14336, 4096), "up_proj": (14336, 4096),
                      "down_proj": (4096, 14336)}
    assert len(blocks) == 4 and gpt.PRESETS["llama3-8b-layers"].block_size == 8192
    torchao_layers = [fqn for fqn, module in model.named_modules() if gpt._fp8_eligible(module, fqn)]
    assert len(torchao_layers) == 4 * 7, "every projection, not the head"


def test_gpt_1b_preset_is_about_a_billion_parameters() -> None:
    with torch.device("meta"):
        model = gpt.PRESETS["gpt-1b"].build()
    count = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < count < 1.05e9, f"{count / 1e9:.3f}e9 parameters"
