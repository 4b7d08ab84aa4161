"""The speed benchmarks run on the CPU with tiny settings and write complete JSON; the FP8
threshold rule reads the right K and N off a grid."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import amp8
from amp8.nn import Fp8Linear
from amp8.quant.scaling import sqnr
from amp8.tools.experiments.gpt import PRESETS
from conftest import ROOT, load_bench

linear = load_bench("linear")
gpt = load_bench("gpt")
common = load_bench("common")

RECORD_FIELDS = ("benchmark", "device", "torch", "date", "baseline", "fp8", "torchao")


def _no_compiler(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("compiler unavailable in this test")


def _assert_record(path: Path, benchmark: str) -> dict[str, Any]:
    record = json.loads(path.read_text())
    missing = [field for field in RECORD_FIELDS if field not in record]
    assert not missing, f"{path.name} lacks {missing}"
    assert record["benchmark"] == benchmark and record["torch"] == torch.__version__
    assert record["torchao"].startswith(("available", "unavailable")), record["torchao"]
    return record


def _assert_timed_or_recorded(name: str, variant: dict[str, Any]) -> None:
    # On the CPU every variant runs (or is skipped for a stated reason): an error fails.
    assert "error" not in variant and ("ms" in variant or "skipped" in variant), f"{name}: {variant}"
    if "ms" in variant:
        assert variant["ms"] > 0 and variant["tflops"] > 0, f"{name}: {variant}"


# -- bench/linear.py ---------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.integration  # torchao's float8 where it is installed
def test_linear_quick_writes_every_variant(tmp_path: Path) -> None:
    path = linear.main(["--quick", "--device", "cpu", "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)])
    record = _assert_record(path, "linear")
    assert path == tmp_path / "linear-cpu.json"
    assert record["baseline"] == "nn.Linear FP32" and record["fp8"] == "emulated on the CPU"
    assert [(r["m"], r["k"], r["n"]) for r in record["rows"]] == [(1024, 2048, 1024)]
    for row in record["rows"]:
        for name, variant in row["variants"].items():
            _assert_timed_or_recorded(name, variant)
        assert row["variants"]["nn.Linear"]["ms"] > 0 and row["variants"]["Fp8Linear"]["ms"] > 0
        assert row["baseline_ms"] > 0 and row["speedup"]["Fp8Linear"] > 0
        assert set(row["speedup"]) == set(linear.CANDIDATES)


def test_linear_records_a_failed_compile_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", _no_compiler)
    row = linear.run_shape((32, 64, 32), torch.device("cpu"), None, warmup=0, repeats=1, compile=True)
    assert "compiler unavailable" in row["variants"]["Fp8Linear compiled"]["error"]
    assert row["variants"]["Fp8Linear"]["ms"] > 0
    assert row["speedup"]["Fp8Linear compiled"] is None and row["speedup"]["Fp8Linear"] > 0
    assert row["variants"]["torchao compiled"] == {"skipped": "torchao unavailable"}


def test_linear_sweep_reports_speedups_per_cell() -> None:
    grid = (32, 64)
    shapes = linear.shapes_to_run(True, 48, grid, quick=False)
    assert shapes[: len(linear.SWEEP)] == linear.SWEEP
    assert shapes[len(linear.SWEEP):] == [(48, 32, 32), (48, 32, 64), (48, 64, 32), (48, 64, 64)]
    rows = [linear.run_shape(s, torch.device("cpu"), None, 0, 1, compile=False) for s in shapes[len(linear.SWEEP):]]
    selection = linear.layer_selection(rows, 48, grid, "CPU")
    assert [(c["k"], c["n"]) for c in selection["cells"]] == [(32, 32), (32, 64), (64, 32), (64, 64)]
    assert all(c["speedup_eager"] > 0 and c["speedup_compiled"] is None for c in selection["cells"])
    assert selection["speed_rule_compiled"] is None
    rule = amp8.nn.selection.SpeedRule.from_json(json.dumps({"speed_rule": selection["speed_rule"]}))
    assert rule == amp8.nn.selection.SpeedRule(**selection["speed_rule_eager"])
    for cell in selection["cells"]:  # the rule takes no cell that was slower
        if rule.selects(cell["k"], cell["n"]):
            assert cell["speedup_eager"] >= 1.0, cell


def test_quick_skips_large_shapes() -> None:
    shapes = linear.shapes_to_run(False, 4096, (1024,), quick=True)
    assert shapes and all(6 * m * k * n <= linear.QUICK_FLOP_LIMIT for m, k, n in shapes)
    assert linear.shapes_to_run(False, 4096, (1024,), quick=False) == linear.HEADLINE


@pytest.mark.parametrize("sweep", [False, True])
def test_linear_listed_shapes_replace_the_default_ones(sweep: bool) -> None:
    listed = linear.parse_args(["--shapes", "64,128,64", "32,32,32"]).shapes
    assert listed == [(64, 128, 64), (32, 32, 32)]
    grid = [(16, 8, 8)] if sweep else []
    assert linear.shapes_to_run(sweep, 16, (8,), quick=False, listed=listed) == listed + grid


@pytest.mark.parametrize("text", ["64,128", "64,0,64", "a,b,c"])
def test_linear_refuses_a_bad_shape(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        linear.parse_args(["--shapes", text])
    assert f"shape {text!r}" in capsys.readouterr().err


# -- bench/gpt.py ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.integration  # torchao's float8 where it is installed
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_gpt_eager_writes_every_run_with_its_optimizer_share(tmp_path: Path, preset: str) -> None:
    if preset.startswith("llama"):
        pytest.importorskip("transformers", reason="the Llama presets need transformers (pip install 'amp8[hf]')")
    path = gpt.main(["--preset", preset, "--steps", "2", "--warmup", "1", "--batch-size", "2",
                     "--device", "cpu", "--modes", "eager", "--out", str(tmp_path)])
    assert path.name == ("gpt-cpu.json" if preset == "tiny" else f"gpt-{preset}-cpu.json")
    record = _assert_record(path, path.stem.removesuffix("-cpu"))
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
    monkeypatch.setattr(torch, "compile", _no_compiler)
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


# -- bench/common.py ---------------------------------------------------------------------
def test_phase_clock_splits_a_step_into_its_phases() -> None:
    clock = common.PhaseClock(torch.device("cpu"))
    clock.mark()
    time.sleep(0.02)
    clock.mark()
    clock.mark()
    first, second = clock.phases_ms()
    assert first >= 20 and 0 <= second < first, (first, second)
    assert clock.marks == [], "the marks are forgotten once read"


def test_write_result_replaces_the_file_whole(tmp_path: Path) -> None:
    device = torch.device("cpu")
    common.write_result("probe", device, {"rows": [1]}, tmp_path)
    path = common.write_result("probe", device, {"rows": [1, 2]}, tmp_path)
    assert json.loads(path.read_text())["rows"] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe-cpu.json"], "no partial file is left"


# -- bench/optimizer.py ------------------------------------------------------------------
optimizer_bench = load_bench("optimizer")


@pytest.mark.parametrize("millions, width, layers", [(1, 256, 15), (1, 128, 61), (1, 2048, 1)])
def test_optimizer_layers_hold_the_asked_parameters_and_all_get_gradients(millions: int, width: int,
                                                                           layers: int) -> None:
    stack = optimizer_bench.square_layers(millions, width, torch.device("cpu"))
    assert len(stack) == layers and all(tuple(layer.weight.shape) == (width, width) for layer in stack)
    optimizer_bench.fill_gradients(stack, torch.device("cpu"))
    norms = torch.stack([layer.weight.grad.norm() for layer in stack])
    assert (norms > 0).all() and norms.max() / norms.min() < 1.01, "every layer gets the same nonzero gradient"


@pytest.mark.slow
@pytest.mark.compile  # LowBitAdam's fused step compiles
def test_optimizer_writes_each_row_with_its_compile_seconds(tmp_path: Path) -> None:
    path = optimizer_bench.main(["--device", "cpu", "--sizes", "1", "--widths", "128", "--levels", "O1",
                                 "--repeats", "1", "--no-memory", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "optimizer-cpu.json" and record["torch_adamw"] == "foreach"
    (row,) = record["step_time"]
    assert row["level"] == "O1" and row["width"] == 128 and row["layers"] == 61, row
    assert row["torch_adamw_ms"] > 0 and row["amp8_fused_ms"] > 0 and row["amp8_ms"] > 0, row
    assert row["fused_first_step_s"] >= row["fused_compile_s"] >= 0, row
    assert row["fused_ratio"] == pytest.approx(row["amp8_fused_ms"] / row["torch_adamw_ms"]), row


linear_kernels = load_bench("linear_kernels")


def test_linear_kernels_least_counts_each_operand_once() -> None:
    m, k, n = 2, 3, 5
    least = linear_kernels.least(m, k, n, input_bytes=2)
    # forward: x read (12 B) and written twice in FP8 (12), x8 and W8 read (6 + 15), y written (20)
    assert least["forward"] == {"kernels": 2, "bytes": 12 + 12 + 6 + 15 + 20}
    # backward: dy read (20) and written twice (20), dgrad reads dy8 and W8 (10 + 15) and writes dx (12),
    # wgrad reads x8 and dy8 (6 + 10) and writes dW in FP8 (15)
    assert least["backward"] == {"kernels": 3, "bytes": 20 + 20 + 10 + 15 + 12 + 6 + 10 + 15}


@pytest.mark.slow
@pytest.mark.compile
def test_linear_kernels_counts_eager_and_compiled_layers(tmp_path: Path) -> None:
    path = linear_kernels.main(["--shape", "16", "32", "32", "--levels", "O2", "--recipes", "tensorwise",
                                "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "linear_kernels-cpu.json" and record["benchmark"] == "linear_kernels"
    eager_ops, eager, compiled = record["rows"]
    assert (eager_ops["mode"], eager["mode"], compiled["mode"]) == ("eager-ops", "eager", "compiled")
    for phase in ("forward", "backward"):
        assert eager_ops[phase]["graph_calls"] == 0 and compiled[phase]["graph_calls"] >= 1, phase
        assert eager[phase]["graph_calls"] >= 1, phase  # amp8's compiled casts
        assert eager_ops[phase]["kernels"] > eager[phase]["kernels"] >= record["least"][phase]["kernels"], phase
        assert eager_ops[phase]["kernels"] > compiled[phase]["kernels"] >= record["least"][phase]["kernels"], phase
        assert eager_ops[phase]["fp8_flops"] == eager[phase]["fp8_flops"] == compiled[phase]["fp8_flops"] > 0, phase
    assert all(row["first_step_s"] > 0 for row in record["rows"])


optimizer_kernels = load_bench("optimizer_kernels")


@pytest.mark.slow
@pytest.mark.compile  # LowBitAdam's fused step compiles
def test_optimizer_kernels_lists_what_each_step_runs(tmp_path: Path) -> None:
    path = optimizer_kernels.main(["--device", "cpu", "--millions", "1", "--width", "256", "--levels", "O1",
                                   "--warmup", "1", "--steps", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "optimizer_kernels-cpu.json" and record["benchmark"] == "optimizer_kernels"
    torch_row, amp8_row = record["rows"]
    assert (torch_row["run"], amp8_row["run"]) == ("torch AdamW foreach", "amp8 O1")
    assert any(name.startswith("aten::_foreach_") for name in torch_row["kernels"])
    assert any(name.startswith("Torch-Compiled Region") for name in amp8_row["kernels"]), "the compiled update"
    for row in record["rows"]:
        assert row["kernel_calls"] == pytest.approx(sum(k["calls"] for k in row["kernels"].values()))
        assert 0 < row["kernel_ms"] <= 1.05 * row["step_ms"], row  # what the step calls lies within it


# -- bench/run_gpu.sh --------------------------------------------------------------------
@pytest.mark.slow  # every Python step of the GPU script, at tiny sizes on the CPU
def test_run_gpu_cpu_check_runs_every_python_step(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--cpu-check", "--quick", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run_gpu.log").read_text()
    for step in ("optimizer", "gpt", "llama", "linear", "kernels", "sweep"):
        assert re.search(rf"^== {step}: \d+ s, ok$", log, re.MULTILINE), f"{step} did not pass:\n{log[-2000:]}"
    assert "== cuda-tests: skipped" in log
    written = {path.name for path in tmp_path.glob("*.json")}
    assert written == {"optimizer-cpu.json", "gpt-cpu.json", "gpt-llama-tiny-cpu.json", "linear-cpu.json",
                       "optimizer_kernels-cpu.json", "linear-sweep-cpu.json"}, written
    llama = json.loads((tmp_path / "gpt-llama-tiny-cpu.json").read_text())
    assert llama["runs"]["amp8 O2"]["eager"]["optimizer_ms"] > 0


@pytest.mark.parametrize("arguments, message", [
    (["--budget", "soon"], "--budget takes whole seconds"), (["--quick"], "--quick goes with --cpu-check"),
    (["--fast"], "unknown option --fast"),
])
def test_run_gpu_refuses_bad_arguments(tmp_path: Path, arguments: list[str], message: str) -> None:
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), *arguments, str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 64 and message in done.stderr, (done.returncode, done.stderr)


# -- bench/numerics_ablation.py ----------------------------------------------------------
numerics = load_bench("numerics_ablation")


def test_numerics_ablation_names_every_variant_of_its_groups() -> None:
    for group, names in numerics.GROUPS.items():
        assert set(names) <= set(numerics.VARIANTS), f"group {group} names unknown variants"
    assert numerics.CONFIGS["docs-lr0.003"].warmup_steps == 0 and numerics.CONFIGS["docs-lr0.003"].lr == 3e-3


def test_numerics_gradient_error_measures_each_source() -> None:
    probe = numerics.gradient_error("stdlib-lr0.003", ["O1-e5m2", "wgrad-high"], train_steps=1, batches=1)
    rows = probe["variants"]
    assert set(rows) == {"O1-e5m2", "wgrad-high"}
    for name, row in rows.items():
        assert 10 < row["weight_grad_sqnr_db"] < 80 and row["worst_layer_sqnr_db"] <= row["weight_grad_sqnr_db"], name
        assert len(row["per_layer_db"]) == 4 * numerics.CONFIGS["stdlib-lr0.003"].model.n_layer
    # The weight-gradient GEMM in high precision removes one of the two roundings of dW.
    assert rows["wgrad-high"]["weight_grad_sqnr_db"] > rows["O1-e5m2"]["weight_grad_sqnr_db"]


def test_numerics_markdown_shows_mean_error_and_seeds() -> None:
    study = {"losses": {"O0": {"0": 2.0, "1": 2.2}, "O1": {"0": 2.02, "1": 2.2}}}
    numerics.summarize(study)
    assert study["mean_gap_percent"]["O1"] == pytest.approx(0.5)
    table = numerics.markdown({"studies": {"cfg": study}})
    assert "| O1 | +0.50 ± 0.50 (2) |" in table and "| O0 seed spread (max-min, %) | 10.00 |" in table


@pytest.mark.slow
def test_memory_bench_measures_every_case_and_fp8_halves_bf16() -> None:
    memory = load_bench("memory")
    rows = memory.run(["tiny"], 2, torch.device("cpu"))["tiny"]
    assert len(rows) == len(memory.cases())
    for row in rows:
        assert row["bytes_per_token"] > 0, row
        if row["activations"] == "fp8":
            assert row["vs_bf16"] <= 0.5, row
    levels = {(row["level"], row["granularity"], row["activations"]): row for row in rows if not row["autocast"]}
    assert levels[("O0", None, "high")]["bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    assert levels[("O2", "tensorwise", "high")]["fp8_bytes_per_param"] == pytest.approx(6.0, abs=0.01)
    print(memory.table({"tiny": rows}).title)


@pytest.mark.slow
@pytest.mark.integration
def test_memory_bench_llama_untied_tables_reach_the_level_bytes() -> None:
    pytest.importorskip("transformers", reason="the Llama example needs transformers (pip install 'amp8[hf]')")
    memory = load_bench("memory")
    case = {"level": "O2", "granularity": "tensorwise", "activations": "high", "autocast": False}
    row = memory.measure(memory.LLAMA, case, 2, torch.device("cpu"))
    # Every FP8 layer and the untied token table at 6 bytes; norms (1/300 of it) at 12.
    assert row["bytes_per_param"] <= 6.1, row


# -- bench/defaults_price.py -------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_defaults_price_counts_llama3_8b_head_flops_exactly() -> None:
    defaults_price = load_bench("defaults_price")
    with torch.device("meta"):
        model = defaults_price._llama3_8b()
    row = defaults_price.price(model)
    head = 6 * 4096 * 128256
    layer = 6 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # q, o; k, v; gate, up, down
    assert row["gemm_flops_per_token"] == 32 * layer + head
    assert row["head_share"] == head / (32 * layer + head) and row["unfit_share"] == 0
    expected = row["expected_h100_speedup_over_bf16"]
    assert 1.0 < expected["rowwise"] < defaults_price.PUBLISHED["rowwise"]
    assert expected["rowwise"] < expected["tensorwise"] < defaults_price.PUBLISHED["tensorwise"]


# -- bench/stress_layers.py --------------------------------------------------------------
def test_stress_layers_outliers_change_nothing_in_exact_arithmetic() -> None:
    """Positions never meet and position 0's loss is ignored: O0 trains bit for bit as
    without the outliers, so every stressed FP8 gap is FP8's."""
    stress_layers = load_bench("stress_layers")
    setup = stress_layers.Setup(width=32, hidden=64, steps=4, batch_size=2, block_size=16, warmup=1)
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    x, y = stress_layers.sample_batch(data, 2, 16, torch.Generator().manual_seed(1))

    def train(stressed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = stress_layers.TokenwiseMLP(setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        injection = stress_layers.Injection(setup)
        if stressed:
            for module in stress_layers.stressed_modules(model):
                module.register_forward_pre_hook(injection)
        model.blocks[3].register_forward_hook(lambda m, args, out: largest.append(float(out.abs().max())))
        for step in range(setup.steps):
            injection.step = step
            optimizer.zero_grad()
            model(x, stress_layers.mask_position(y, 0))[1].backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    largest: list[float] = []
    stressed = train(True)
    assert max(largest) > 2.0**40, "the outliers reach the residual stream"
    for stressed_param, plain in zip(stressed, train(False)):
        assert torch.equal(stressed_param, plain)


# -- bench/moe_gemm.py -------------------------------------------------------------------
@pytest.mark.slow  # a benchmark run end to end (its quick case)
def test_moe_gemm_quick_times_every_variant_side_by_side(tmp_path: Path) -> None:
    moe_gemm = load_bench("moe_gemm")
    path = moe_gemm.main(["--quick", "--device", "cpu", "--warmup", "0", "--rounds", "1", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path == tmp_path / "moe-gemm-cpu.json" and record["baseline"] == moe_gemm.BASELINE
    (row,) = record["rows"]
    variants = {moe_gemm.BASELINE, moe_gemm.GROUPED, *moe_gemm.CANDIDATES}
    dense = {moe_gemm.DENSE, *moe_gemm.DENSE_FP8}
    assert set(row["ms"]) == variants | dense and all(ms > 0 for ms in row["ms"].values())
    assert set(row["ratio_to_baseline"]) == variants - {moe_gemm.BASELINE}
    assert set(row["dense_fp8_ratio"]) == set(moe_gemm.DENSE_FP8)
    for recipe, over in row["experts_over_dense"].items():
        expected = row["ratio_to_baseline"][f"Fp8Experts {recipe}"] / row["dense_fp8_ratio"][f"dense Fp8Linear {recipe}"]
        assert over == pytest.approx(expected)


def test_moe_gemm_variants_compute_the_same_experts() -> None:
    moe_gemm = load_bench("moe_gemm")
    torch.manual_seed(0)
    loop = moe_gemm.LoopExperts(4, 32, 16)
    grouped = moe_gemm.GroupedExperts(4, 32, 16)
    grouped.load_state_dict(loop.state_dict())
    index, weights = moe_gemm.routing(24, 4, 2, "skewed", torch.device("cpu"))
    x = torch.randn(24, 32)
    torch.testing.assert_close(grouped(x, index, weights), loop(x, index, weights), atol=1e-5, rtol=1e-5,
                               msg="the grouped reference computes the loop's experts")


def test_moe_gemm_dense_yardstick_runs_the_experts_shapes_and_its_fp8_copy_the_same_weights() -> None:
    moe_gemm = load_bench("moe_gemm")
    torch.manual_seed(0)
    mlp = moe_gemm.DenseMlp(32, 16)
    assert tuple(mlp.gate_up.weight.shape) == (32, 32) and tuple(mlp.down.weight.shape) == (32, 16)
    rows = torch.randn(24, 32)
    for recipe in moe_gemm.RECIPES.values():
        fp8 = moe_gemm.fp8_mlp(mlp, recipe)
        assert isinstance(fp8.gate_up, Fp8Linear) and fp8.gate_up.weight_storage is moe_gemm.STORAGE
        assert sqnr(mlp(rows), fp8(rows)) > 20.0, "the FP8 copy computes the same MLP"


@pytest.mark.slow
@pytest.mark.integration
def test_lora_bench_measures_bytes_and_paired_gaps_of_every_variant() -> None:
    pytest.importorskip("peft", reason="bench/lora.py needs peft: pip install 'amp8[dev]'")
    lora = load_bench("lora")
    rows = {row["level"]: row for row in lora.base_bytes(lora.LlamaSpec(n_layer=1), rank=8)}
    assert set(rows) == set(lora.LEVELS)
    assert rows["O3"]["fp8_layer_base_bytes_per_param"] <= 1.1
    assert rows["O1"]["fp8_layer_base_bytes_per_param"] == pytest.approx(2.0, abs=1e-3)
    config = lora.StudyConfig(seeds=(0, 1), pretrain_steps=1, finetune_steps=2, batch_size=2, warmup=1, eval_batches=1)
    result = lora.study(config)
    assert set(result["gap_percent"]) == set(lora.VARIANTS) - {"fp32"}
    assert all(len(gap["per_seed"]) == 2 and gap["stderr"] is not None for gap in result["gap_percent"].values())
    assert result["gap_percent"]["null"]["mean"] == pytest.approx(0.0, abs=0.01)


def test_classifier_head_study_pairs_the_head_variants(tmp_path: Path) -> None:
    """bench/classifier_head.py: the FP8 head variant runs its classifier as an Fp8Linear,
    the high one keeps it an nn.Linear, and every paired gap is over the same seeds."""
    classifier_head = load_bench("classifier_head")
    config = classifier_head.Config(steps=2, seeds=(0, 1), batch_size=4, eval_samples=8, warmup=1)
    result = classifier_head.study(config)
    assert [row["head_fp8"] for row in result["O2 head fp8"]["runs"]] == [True, True]
    assert [row["head_fp8"] for row in result["O2 head high"]["runs"]] == [False, False]
    for name in classifier_head.GAPS:
        assert len(result[name]["per_seed"]) == 2 and result[name]["stderr"] >= 0, name
    tokens, labels = classifier_head.batch(config, torch.Generator().manual_seed(0), 64)
    votes = torch.nn.functional.one_hot(tokens % config.labels, config.labels).sum(1)
    assert torch.equal(votes.argmax(-1), labels) and votes.max(-1).values.min() >= config.planted


# -- bench/step_profile.py ---------------------------------------------------------------
step_profile = load_bench("step_profile")


def test_step_profile_tiny_counts_every_level_and_phase(tmp_path: Path) -> None:
    """Every level's step splits into the three phases; the GEMM FLOPs are the same work
    at every level, all high precision at O0 and mostly FP8 at O1-O3."""
    path = step_profile.main(["--preset", "tiny", "--batch-size", "2", "--steps", "1", "--optimizer", "reference",
                              "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["benchmark"] == "step_profile-tiny" and record["torch"] == torch.__version__
    assert set(record["levels"]) == set(step_profile.LEVELS)
    gemm = {}
    for level, result in record["levels"].items():
        phases = result["phases"]
        for name in step_profile.PHASES:
            assert phases[name]["ops"] > 0 and phases[name]["bytes"] > 0 and phases[name]["cpu_ms"] > 0, (level, name)
            assert result["modeled_h100_ms"][name]["gpu_ms"] > 0, (level, name)
            stretches = result["stretches"][name]  # the phase split at its syncs, nothing lost
            assert len(stretches) == phases[name]["syncs"] + 1, (level, name, stretches)
            for key in step_profile.COUNTS:
                assert sum(s[key] for s in stretches) == phases[name][key], (level, name, key)
        assert result["modeled_h100_ms"]["step"] >= max(r["gpu_ms"] for n, r in result["modeled_h100_ms"].items()
                                                        if n in step_profile.PHASES), level
        gemm[level] = [phases[p]["fp8_flops"] + phases[p]["other_flops"] for p in ("forward", "backward")]
        fp8 = phases["forward"]["fp8_flops"] + phases["backward"]["fp8_flops"]
        assert (fp8 == 0) == (level == "O0"), (level, fp8)
    assert all(gemm[level] == gemm["O0"] for level in step_profile.LEVELS), gemm
    parts = [name for name in record["levels"]["O1"]["phases"] if name.startswith("optimizer: ")]
    assert "optimizer: finite check" in parts and "optimizer: weight store" in parts, parts
    part_ops = sum(record["levels"]["O1"]["phases"][name]["ops"] for name in parts)
    assert part_ops == record["levels"]["O1"]["phases"]["optimizer"]["ops"]
    assert all(r["phases"]["optimizer"]["graph_calls"] == 0 for r in record["levels"].values())  # all eager


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_step_profile_counts_compiled_blocks(level: str) -> None:
    """Blocks compiled as bench/gpt.py compiles them are counted as graph calls (one per
    block, forward and backward) whose GEMMs keep the eager step's FLOPs; at O1 inductor
    fuses the FP8 casts into far fewer kernels and bytes than the eager operations."""
    config = dataclasses.replace(PRESETS["tiny"], n_layer=1)
    counts = {blocks: step_profile.profile(level, config, 2, 0, "all", "compiled", blocks)[0]
              for blocks in ("eager", "compiled")}
    for phase in ("forward", "backward"):
        eager, compiled = counts["eager"][phase], counts["compiled"][phase]
        assert compiled["graph_calls"] == 1 and eager["graph_calls"] == 0, (phase, compiled)
        flops = {blocks: (row[phase]["fp8_flops"], row[phase]["other_flops"]) for blocks, row in counts.items()}
        assert flops["compiled"] == flops["eager"], (phase, flops)
        if level == "O1":
            assert compiled["ops"] + compiled["graph_kernels"] < eager["ops"] / 2, (phase, compiled, eager)
            assert compiled["bytes"] + compiled["graph_bytes"] < eager["bytes"] / 2, (phase, compiled, eager)


compiled_graphs = load_bench("compiled_graphs")


def _scale_and_bump(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y.add_(1)  # written in place: read and written by the graph
    return x * 2, (x + y).amax()


_compiled_scale_and_bump = torch.compile(_scale_and_bump, fullgraph=True, dynamic=True)


@pytest.mark.parametrize("n", [8, 40])
@pytest.mark.parametrize("calls", [1, 3])
def test_step_profile_counts_compiled_graph_calls_and_their_bytes(n: int, calls: int) -> None:
    """Each call of a compiled graph is counted with the bytes its kernels move, at least
    its inputs and outputs once each; what runs inside it is not counted again as eager
    operations."""
    x, y = torch.randn(n), torch.randn(n)
    _compiled_scale_and_bump(x, y)  # compiled outside the count
    counter = step_profile.StepCounter()
    with counter, counter.phase("optimizer"):
        for _ in range(calls):
            _compiled_scale_and_bump(x, y)
        x.mul_(3)  # one eager operation beside the graphs
    row = counter.totals()["optimizer"]
    assert row["graph_calls"] == calls, row
    assert calls * 4 * (n + n + n + 1) <= row["graph_bytes"] <= calls * 4 * 3 * (n + n + n + 1), row  # x, y; 2x, amax
    assert row["graph_kernels"] >= calls, row
    assert row["ops"] == 1 and row["bytes"] == 4 * 2 * n, row


def _generated_source(nests: int, calls: int, extern: int) -> str:
    """Inductor-style source: a C++ kernel of ``nests`` loop nests called ``calls`` times on
    its float32 argument (s0 x 4 elements) and a buffer it allocates, ``extern`` GEMMs and
    one fallback operation."""
    loops = "\n".join("        for(int64_t x0=static_cast<int64_t>(0L); x0<ks0; x0+=16) {}" for _ in range(nests))
    return (f"cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''\n{loops}\n''')\n"
            "class Runner:\n    def call(self, args):\n        arg0_1, arg1_1 = args\n        args.clear()\n"
            "        s0 = arg0_1\n        buf0 = empty_strided_cpu((s0, 4), (4, 1), torch.float32)\n"
            "        buf1 = buf0; del buf0  # reuse\n"
            + "        cpp_fused_add_0(arg1_1, buf1)\n" * calls + "        extern_kernels.mm(a, b, out=c)\n" * extern
            + "        buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)\n")


@pytest.mark.parametrize("nests, calls, extern", [(1, 1, 0), (2, 3, 1), (4, 2, 2)])
def test_step_profile_kernels_of_generated_code(nests: int, calls: int, extern: int) -> None:
    """A generated C++ kernel counts one GPU kernel per outermost loop nest, per call; each
    extern kernel and fallback operation one."""
    assert compiled_graphs.kernel_launches(_generated_source(nests, calls, extern)) == nests * calls + extern + 1


@pytest.mark.parametrize("rows, calls", [(3, 1), (10, 2)])
def test_step_profile_kernel_bytes_of_generated_code(rows: int, calls: int) -> None:
    """Each generated kernel call moves its arguments: an input and a buffer sized from the
    call's symbolic size (reused under another name)."""
    x = torch.zeros(rows, 4)
    source = _generated_source(1, calls, 0)
    assert compiled_graphs.kernel_bytes(source, [rows, x]) == calls * 2 * x.nbytes


@pytest.mark.parametrize("level", ["O1"])
def test_step_profile_counts_the_compiled_low_bit_adam_step(level: str) -> None:
    """LowBitAdam's compiled step is seen as graph calls (however it groups the
    parameters) that read and write at least its moments and weights once each."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level,
                                       layer_selection="all")
    fused = amp8.optim.LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level,
                                                 fused=True)
    model(torch.randn(4, 32)).sum().backward()
    fused.step()  # compiles
    counter = step_profile.StepCounter()
    with counter, counter.phase("optimizer"):
        fused.step()
    row = counter.totals()["optimizer"]
    state = sum(t.nbytes for s in fused.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    weights = sum(handle.data.nbytes for handle in fused.weights.values())
    assert 1 <= row["graph_calls"] <= 2, row
    assert row["graph_bytes"] >= 2 * (state + weights), (row, state, weights)


@pytest.mark.parametrize("m, k, n", [(4, 8, 16), (32, 16, 8)])
def test_step_profile_counter_counts_a_matmul_and_skips_views(m: int, k: int, n: int) -> None:
    a, b = torch.randn(m, k), torch.randn(k, n)
    counter = step_profile.StepCounter()
    with counter, counter.phase("forward"):
        (a.t().t() @ b.view(k, n)).view(-1)
    row = counter.counts["forward"]
    assert row["ops"] == 1 and row["other_flops"] == 2 * m * k * n and row["fp8_flops"] == 0, row
    assert row["bytes"] == 4 * (m * k + k * n + m * n), row


@pytest.mark.parametrize("layout", ["per mode", "compiled only"])
def test_step_profile_reads_the_compiled_row_of_either_gpt_record(layout: str) -> None:
    compiled, eager = {"step_ms": 110.0}, {"step_ms": 180.0}
    run = {"compiled": compiled, "eager": eager} if layout == "per mode" else compiled
    record = {"runs": {"baseline": run}}
    assert step_profile.compiled_row(record, "baseline") == compiled
    assert step_profile.compiled_row(record, "amp8 O3") == {}


def test_step_profile_solves_bilinear_counts_exactly() -> None:
    def f(blocks: int, batch: int) -> float:
        return 7 + 3 * blocks + 5 * batch + 11 * blocks * batch

    points = {point: f(*point) for point in step_profile.GPT_1B_POINTS}
    assert step_profile.solve_bilinear(points, 20, 8) == f(20, 8)


def test_step_profile_reads_of_host_scalars_are_no_syncs() -> None:
    """A read of the optimizer's CPU step count neither syncs nor launches a kernel; a read
    of a value computed on the device syncs and ends the phase's stretch."""
    step, x = torch.zeros(()), torch.randn(8)
    counter = step_profile.StepCounter([step])
    with counter, counter.phase("optimizer"):
        step += 1
        float(step)  # a host read
        if bool((x * 2).sum() > 0):  # a device read: three kernels, then the sync
            pass
        x.mul_(3)
    first, second = counter.stretches["optimizer"]
    assert (first["ops"], first["host_ops"], first["syncs"]) == (3, 1, 1), first
    assert (second["ops"], second["host_ops"], second["syncs"]) == (1, 0, 0), second
    assert counter.totals()["optimizer"]["syncs"] == 1


def _counts(ops: float = 0, nbytes: float = 0) -> dict[str, float]:
    return {**dict.fromkeys(step_profile.COUNTS, 0), "ops": ops, "bytes": nbytes}


# 1 ms of host time per eager op, 1 ms of GPU time per kB; nothing else costs anything.
_MS_MODEL = step_profile.H100Model(launch_s=1e-3, kernel_s=0.0, bandwidth=1e6)


@pytest.mark.parametrize("host_ms, gpu_ms", [(10, 2), (2, 10), (5, 5)])
def test_step_profile_a_stretch_takes_the_longer_clock(host_ms: int, gpu_ms: int) -> None:
    """One stretch, host-bound or GPU-bound: the host queues while the GPU works."""
    stretch = _counts(ops=host_ms, nbytes=1000 * gpu_ms)
    assert _MS_MODEL.step_seconds([("forward", stretch, False)]) == pytest.approx(1e-3 * max(host_ms, gpu_ms))


@pytest.mark.parametrize("sync, step_ms", [(False, 10), (True, 20)])
def test_step_profile_a_sync_joins_the_clocks(sync: bool, step_ms: int) -> None:
    """GPU work (10 ms) then host work (10 ms): without a sync between them the host's work
    overlaps the GPU's; with one the host waits for the GPU first and the two add up."""
    stretches = [("forward", _counts(nbytes=10_000), sync), ("optimizer", _counts(ops=10), False)]
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(1e-3 * step_ms)


def test_step_profile_gpu_never_runs_ahead_of_the_host() -> None:
    """Host work (10 ms) then GPU work (10 ms): the GPU gets the second stretch only once the
    host has queued it, so they add up even without a sync."""
    stretches = [("forward", _counts(ops=10), False), ("backward", _counts(nbytes=10_000), False)]
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(20e-3)


@pytest.mark.parametrize("host_ms, gpu_ms", [(4, 10), (10, 4)])
def test_step_profile_phases_on_the_gpu_clock(host_ms: int, gpu_ms: int) -> None:
    """A phase's CUDA-event time: from when the GPU is done with the work before it (and
    the host has got there) to when it is done with the phase's own. GPU work (``gpu_ms``)
    then host work (``host_ms``) and GPU work (10 ms) after a sync."""
    stretches = [("backward", _counts(nbytes=1000 * gpu_ms), False),
                 ("optimizer", _counts(ops=host_ms), True), ("optimizer", _counts(nbytes=10_000), False)]
    assert _MS_MODEL.phase_seconds(stretches, ("backward",)) == pytest.approx(1e-3 * gpu_ms)
    optimizer = max(host_ms, gpu_ms) - gpu_ms + 10  # the host's launches run on past the backward's GPU work
    assert _MS_MODEL.phase_seconds(stretches, ("optimizer",)) == pytest.approx(1e-3 * optimizer)
    assert _MS_MODEL.step_seconds(stretches) == pytest.approx(1e-3 * (max(host_ms, gpu_ms) + 10))


def test_step_profile_device_time_of_the_modeled_bytes() -> None:
    """The GEMMs' operand bytes move in their FLOPs' time, torch's fused AdamW's unseen
    writes at the bandwidth, and amp8's eager optimizer bytes at the eager bandwidth."""
    model = step_profile.H100Model(bandwidth=1e6, eager_bandwidth=2.5e5, kernel_s=0.0, bf16_rate=1e9)
    counts = {**_counts(nbytes=3000), "graph_bytes": 5000, "other_flops": 4e6, "gemm_bytes": 2000,
              "unseen_writes": 1000, "amp8_eager_bytes": 500}
    assert model.device_seconds(counts) == pytest.approx(1e-3 * (6.5 + 2 + 4))  # 6,500 B, 500 B slow, 4 MFLOP


def _gpt_result(level: str) -> dict[str, Any]:
    """A level's counts as ``profile`` gives them: the forward and backward with GEMM FLOPs,
    the optimizer split at its finite check's sync, torch's fused AdamW in the last stretch
    (the whole step at O0, amp8's plain step of 16 bytes at O1)."""
    forward = {**_counts(nbytes=100), "other_flops": 10}
    first, last = _counts(nbytes=40), _counts(nbytes=32)
    phases = {"forward": dict(forward), "backward": _counts(nbytes=50), "optimizer": _counts(nbytes=72),
              "optimizer: plain step": _counts(nbytes=16)}
    stretches = {"forward": [dict(forward)], "backward": [_counts(nbytes=50)],
                 "optimizer": [last] if level == "O0" else [first, last]}
    if level == "O0":
        phases["optimizer"] = _counts(nbytes=32)
    return {"phases": phases, "stretches": stretches}


@pytest.mark.parametrize("level, writes, amp8_eager", [("O0", 24, [0]), ("O1", 12, [40, 16])])
def test_step_profile_adds_the_bytes_the_counter_cannot_give(level: str, writes: float,
                                                              amp8_eager: list[float]) -> None:
    """GEMM bytes go to the stretches with GEMM FLOPs; torch's fused AdamW writes 12 bytes
    for every 16 it is counted with, in the optimizer's last stretch; amp8's eager bytes are
    the rest of the optimizer's; setting them twice (a JSON modeled again) changes nothing."""
    result = _gpt_result(level)
    for _ in range(2):
        step_profile.add_modeled_bytes(level, result, {"forward": 60, "backward": 70})
    phases, stretches = result["phases"], result["stretches"]
    assert phases["forward"]["gemm_bytes"] == stretches["forward"][0]["gemm_bytes"] == 60
    assert phases["backward"]["gemm_bytes"] == 0  # no GEMM FLOPs there
    assert [s["unseen_writes"] for s in stretches["optimizer"]][-1] == phases["optimizer"]["unseen_writes"] == writes
    assert [s["amp8_eager_bytes"] for s in stretches["optimizer"]] == amp8_eager


class _GemmBytes(step_profile.StepCounter):
    """The counter, also summing per phase the bytes it counts for operations with FLOPs."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gemm: dict[str, float] = {}

    def _count(self, name: str | None, **values: float) -> None:
        if values.get("fp8_flops") or values.get("other_flops"):
            moved = values.get("bytes", 0) + values.get("graph_bytes", 0)
            self.gemm[self.current] = self.gemm.get(self.current, 0) + moved
        super()._count(name, **values)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_step_profile_gemm_operand_bytes_are_those_counted(level: str) -> None:
    """The GEMMs' and attention's bytes ``gemm_operand_bytes`` derives from the shapes are
    those the counter counts for them, BF16 or FP8 (within their biases, scales and log-sum-exp)."""
    config, batch = PRESETS["tiny"], 2
    model, optimizer = step_profile.build(level, config, "all", "reference")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=generator)
    step_profile.run_step(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), None)
    counter = _GemmBytes(step_profile.host_scalars(optimizer))
    step_profile.run_step(model, optimizer, (tokens[:, :-1], tokens[:, 1:]), counter)
    derived = step_profile.gemm_operand_bytes(config, batch, level, "all")
    for phase in ("forward", "backward"):
        assert derived[phase] == pytest.approx(counter.gemm[phase], rel=0.03), (phase, derived, counter.gemm)


def _kernel(us: float, calls: float = 1.0) -> dict[str, float]:
    return {"us": us, "calls": calls}


def test_step_profile_measures_bandwidth_and_kernel_cost() -> None:
    """torch's fused AdamW moves 28 bytes per parameter in its kernels' time; a kernel
    that moves next to nothing costs the median of the short calls."""
    record = {"millions": 2, "width": 1024, "rows": [
        {"run": "torch AdamW fused", "kernel_ms": 28 * 2 * 1024**2 / 1e9,  # 1 TB/s
         "kernels": {"adam": _kernel(1000.0), "step": _kernel(3.0, 3)}},
        {"run": "amp8 O1", "kernel_ms": 1.0, "kernels": {"copy": _kernel(2.0), "memset": _kernel(4.0, 2),
                                                         "update": _kernel(900.0)}},
    ]}
    assert step_profile.measured_bandwidth(record) == pytest.approx(1e12)
    assert step_profile.measured_kernel_s(record) == pytest.approx(2e-6)  # of 1, 2 and 2 us


@pytest.mark.parametrize("cost_ps", [0.4, 0.6])
def test_step_profile_measures_the_update_and_eager_kernels(cost_ps: float) -> None:
    """Update kernels that take their graph's bytes at the bandwidth plus ``cost_ps`` per
    integer operation give that cost back per level; the other kernels' time over the eager
    bytes is the eager bandwidth."""
    model = step_profile.H100Model(bandwidth=1e12)
    rows, counted = [], []
    for level, ints, graph in (("O1", 1e10, 4e9), ("O2", 3e10, 2e9)):
        update_us = 1e6 * (graph / 1e12 + ints * cost_ps * 1e-12)
        rows.append({"run": f"amp8 {level}", "kernel_ms": 1e-3 * update_us + 2.0,  # 2 ms of eager kernels
                     "kernels": {"triton_red_fused_update_0": _kernel(0.75 * update_us),
                                 "_scatter_gather_elementwise_kernel": _kernel(0.25 * update_us)}})
        counted.append({"millions": 300, "level": level, "stretches": [
            _counts(nbytes=1e9), {**_counts(nbytes=0.5e9), "graph_bytes": graph, "int_ops": ints}]})
    record = {"millions": 300, "rows": rows}
    costs = step_profile.measured_int_op_s(model, record, counted)
    assert costs == {"O1": pytest.approx(cost_ps * 1e-12), "O2": pytest.approx(cost_ps * 1e-12)}
    assert step_profile.measured_eager_bandwidth(record, counted) == pytest.approx(1.5e9 / 2e-3)
    with pytest.raises(ValueError, match="no counted optimizer step"):
        step_profile.measured_int_op_s(model, {**record, "millions": 30}, counted)


def test_step_profile_reads_the_gemm_rates_at_the_largest_shapes() -> None:
    record = {"rows": [
        {"flop": 6e9, "variants": {"nn.Linear compiled": {"ms": 1.0}, "Fp8Linear compiled": {"ms": 4.0}}},
        {"flop": 6e12, "variants": {"nn.Linear compiled": {"ms": 10.0}, "Fp8Linear compiled": {"ms": 6.0}}},
        {"flop": 6e12, "variants": {"nn.Linear compiled": {"ms": 14.0}, "Fp8Linear compiled": {"ms": 6.0}}},
    ]}
    assert step_profile.measured_gemm_rates(record) == (pytest.approx(5e14), pytest.approx(1e15))


def test_step_profile_measured_constants_of_the_h100_records_are_physical() -> None:
    """The constants measured on the recorded H100 runs lie under the H100's peaks
    (3.35 TB/s, 989 and 1979 dense TFLOP/s) and match the model's defaults."""
    model, calibrated = step_profile.measured_model(json.loads(step_profile.LINEAR_RECORDED.read_text()),
                                                    json.loads(step_profile.KERNELS_RECORDED.read_text()))
    assert 0.5e12 < model.bandwidth < 3.35e12 and 0.3e15 < model.bf16_rate < model.fp8_rate < 1.979e15
    assert 0.5e-6 < model.kernel_s < 5e-6 and len(calibrated) >= 4
    defaults = step_profile.H100Model()
    for name in ("bandwidth", "bf16_rate", "fp8_rate", "kernel_s"):
        assert getattr(model, name) == pytest.approx(getattr(defaults, name), rel=0.01), name


optimizer_host = load_bench("optimizer_host")


def test_optimizer_host_counts_a_fixed_number_of_operations(tmp_path: Path) -> None:
    """bench/optimizer_host.py, eager rows only: the grouped step dispatches as many
    operations for 6 layers as for 2, the per-tensor step more, and every row is written."""
    path = optimizer_host.main(["--layers", "2", "6", "--repeats", "1", "--no-compile", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["benchmark"] == "optimizer_host" and record["torch"] == torch.__version__
    small, large = record["rows"]
    for level in optimizer_host.LEVELS:
        assert small[f"{level}_grouped_ops"] == large[f"{level}_grouped_ops"], level
        assert small[f"{level}_per_tensor_ops"] < large[f"{level}_per_tensor_ops"], level
        assert large[f"{level}_grouped_ms"] > 0 and f"{level}_grouped_compiled_ms" not in large


# -- bench/report_log.py -----------------------------------------------------------------
def test_report_log_bench_writes_the_logs_share_of_a_step(tmp_path: Path) -> None:
    bench = load_bench("report_log")
    path = bench.main(["--preset", "tiny", "--repeats", "1", "--levels", "O1", "--every", "10", "--out", str(tmp_path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["plain_step_s"] > 0 and row["record_s"] > 0 and row["every"] == 10
    assert row["share_of_step"] == pytest.approx(bench.share_of_step(row, 10))


def test_layer_host_times_one_forward_per_level() -> None:
    layer_host = load_bench("layer_host")
    times = layer_host.measure(repeats=3)
    assert set(times) == set(layer_host.LEVELS) and all(0 < t < 1 for t in times.values())
