"""Every example runs, with small settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import EXAMPLES as _EXAMPLES
from conftest import load_example as _load


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_mnist_like_learns(opt_level: str) -> None:
    example = _load("mnist_like")
    accuracy, _, optimizer = example.train(example.Config(opt_level=opt_level, epochs=3))
    assert accuracy > 0.85, f"{opt_level}: test accuracy {accuracy:.3f}"
    assert getattr(optimizer, "skipped_steps", 0) == 0


def test_mnist_like_refuses_an_unknown_opt_level(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    example = _load("mnist_like")
    monkeypatch.setattr(sys, "argv", ["mnist_like.py", "--opt-level", "O5"])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 2
    assert "argument --opt-level: invalid choice: 'O5' (choose from 'O0', 'O1', 'O2', 'O3')" in capsys.readouterr().err


@pytest.mark.slow
def test_gpt_trains_and_samples() -> None:
    example = _load("gpt")
    config = example.Config(steps=20, batch_size=4, eval_every=10, n_embd=64)
    loss, model = example.train(config)
    assert loss < 4.5, f"validation loss {loss:.3f} after 20 steps (ln 256 = 5.55)"
    text = example.sample(model, b"def ", 8)
    assert text.startswith(b"def ") and len(text) == 12


@pytest.mark.slow  # a fresh Python process
def test_gpt_command_line() -> None:
    result = subprocess.run(
        [sys.executable, str(_EXAMPLES / "gpt.py"), "--steps", "2", "--eval-every", "1", "--batch-size", "2",
         "--n-embd", "32", "--opt-level", "O0"],
        capture_output=True, text=True, timeout=300, cwd=_EXAMPLES.parent,
        env={**os.environ, "PYTHONPATH": str(_EXAMPLES.parent)},  # this checkout's amp8
    )
    assert result.returncode == 0, result.stderr
    assert "final validation loss" in result.stdout


@pytest.mark.integration
def test_hf_transformers_trains_in_fp8() -> None:
    pytest.importorskip("transformers", reason="the hf example needs transformers: pip install 'amp8[hf]'")
    import amp8

    example = _load("hf_transformers")
    losses, model, optimizer = example.train(example.Config(steps=3, batch_size=2))
    assert losses[-1] < losses[0], losses
    report = amp8.report(model, optimizer)
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear, "O1 keeps the output head in high precision"
    head_numel = head.weight.numel()
    assert report.fp8_share > 0.8 * (1 - head_numel / sum(p.numel() for p in model.parameters())), report.summary()
    assert optimizer.skipped_steps == 0


@pytest.mark.integration
def test_hf_trainer_example_trains() -> None:
    import amp8

    example = _load("hf_trainer")
    losses, model, optimizer = example.train(example.Config(steps=3, batch_size=2))
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    projections = {name: module for name, module in model.named_modules() if name.endswith("_proj")}
    assert len(projections) == 14 and all(isinstance(m, amp8.nn.Fp8Linear) for m in projections.values())
    assert type(model.lm_head) is torch.nn.Linear, "the default recipe keeps the output head in high precision"
    assert amp8.report(model, optimizer).fp8_share > 0.65  # the head and the tables are 29 % of this small model
    assert optimizer.skipped_steps == 0


@pytest.mark.integration
def test_accelerate_example_trains() -> None:
    example = _load("accelerate_train")
    losses, _, optimizer = example.train(example.Config(epochs=2, samples=128))
    assert losses[-1] < 0.8 * losses[0], losses
    assert optimizer.skipped_steps == 0


@pytest.mark.integration
def test_lightning_example_trains() -> None:
    example = _load("lightning_train")
    before, after, module = example.train(example.Config(max_steps=10, samples=128))
    assert after < 0.8 * before, f"loss {before:.4f} -> {after:.4f}"
    assert module.amp8_optimizer.skipped_steps == 0


@pytest.mark.integration
def test_moe_example_trains_a_mixtral_with_fp8_experts_at_o2s_bytes() -> None:
    pytest.importorskip("transformers", reason="the MoE example needs transformers: pip install 'amp8[hf]'")
    import amp8

    example = _load("moe")
    losses, model, optimizer = example.train(example.Config(steps=4, batch_size=2))
    assert losses[-1] < losses[0], losses
    assert isinstance(model.model.layers[0].mlp.experts, amp8.nn.Fp8Experts)
    report = amp8.report(model, optimizer)
    assert report.bytes_per_param <= 6.5 and report.fp8_share >= 0.95, report.summary()
    exported = amp8.export(model, optimizer)
    assert type(exported.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


@pytest.mark.integration
@pytest.mark.parametrize("order", ["amp8-first", "lora-first"])
def test_lora_finetune_example_trains_the_adapters_on_an_fp8_base(order: str) -> None:
    pytest.importorskip("peft", reason="the LoRA example needs peft: pip install 'amp8[dev]'")
    import amp8

    example = _load("lora_finetune")
    losses, model, optimizer = example.train(example.Config(order=order, steps=4, batch_size=2))
    assert losses[-1] < losses[0], losses
    report = amp8.report(model, optimizer)
    assert report.frozen_bytes_per_param(fp8_layers_only=True) <= 1.1, report.summary()
    merged = amp8.export(model).merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
