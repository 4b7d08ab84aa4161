"""LoRA through Hugging Face PEFT on an amp8 base, in either order: what the frozen base
stores, that the adapters stay in high precision and train, merging, export, checkpoints,
the bytes per frozen base parameter, and the adapters' gradient numerics."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from conftest import assert_bitwise_equal, assert_sqnr_at_least

peft = pytest.importorskip("peft", reason="LoRA tests need peft: pip install 'amp8[dev]'")
transformers = pytest.importorskip("transformers", reason="LoRA tests need transformers: pip install 'amp8[dev]'")
from amp8.nn.peft_lora import Fp8LoraLinear  # noqa: E402  (needs peft)

pytestmark = pytest.mark.integration

LEVELS = ["O1", "O2", "O3"]
ORDERS = ["amp8-first", "lora-first"]
TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK = 16  # a multiple of 16: the adapters stay high only because they are adapters


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def _config() -> Any:
    return peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _lora_model(order: str, level: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A LoRA model on an amp8 base at ``level``, built in ``order``, with its optimizer."""
    model = _llama(seed)
    if order == "amp8-first":
        model, _ = amp8.initialize(model, None, level)
        model = peft.get_peft_model(model, amp8.nn.register_lora(_config()))
        return model, torch.optim.AdamW(_trainable(model), lr=1e-2)
    model = peft.get_peft_model(model, _config())
    return amp8.initialize(model, torch.optim.AdamW(_trainable(model), lr=1e-2), level)  # type: ignore[return-value]


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("order", ORDERS)
def test_lora_trains_adapters_on_a_frozen_fp8_base_in_either_order(order: str, level: str) -> None:
    model, optimizer = _lora_model(order, level)
    layers = _lora_layers(model)
    assert len(layers) == len(TARGETS)
    for layer in layers:
        assert type(layer) is Fp8LoraLinear and type(layer.base_layer) is Fp8Linear
        assert type(layer.lora_A["default"]) is nn.Linear and type(layer.lora_B["default"]) is nn.Linear
        assert layer.lora_A["default"].weight.dtype == torch.float32
    bases = {layer.base_layer: (layer.base_layer.weight.detach().clone(), layer.base_layer.weight_scale.clone())
             for layer in layers}
    adapter_before = layers[0].lora_B["default"].weight.detach().clone()
    for step in range(3):
        model(input_ids=_ids(step), labels=_ids(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for base, (stored, scale) in bases.items():
        assert base.weight.grad is None and not optimizer.state.get(base.weight)
        assert_bitwise_equal(base.weight.detach(), stored)
        assert_bitwise_equal(base.weight_scale, scale)
    assert not torch.equal(layers[0].lora_B["default"].weight, adapter_before), "the adapters must train"
    rows = {row.name: row for row in amp8.report(model, optimizer).rows}
    base_rows = [row for name, row in rows.items() if name.endswith("base_layer.weight")]
    assert len(base_rows) == len(TARGETS) and all(row.grad == "frozen" and row.fp8 for row in base_rows)
    adapter_rows = [row for name, row in rows.items() if ".lora_A." in name]
    assert all(row.note.startswith("adapter lora_A") for row in adapter_rows), adapter_rows


@pytest.mark.parametrize("order", ORDERS)
def test_merge_is_refused_with_the_fix_and_export_then_merge_gives_a_plain_model(order: str) -> None:
    model, _ = _lora_model(order, "O1")
    with torch.no_grad():
        for layer in _lora_layers(model):
            layer.lora_B["default"].weight.normal_(0, 0.05)  # a delta to merge
    with pytest.raises(ValueError, match=r"amp8\.export\(model\)\.merge_and_unload\(\)"):
        model.merge_and_unload()
    exported = amp8.export(model)
    assert all(type(layer) is peft.tuners.lora.Linear for layer in _lora_layers(exported))
    expected = exported(input_ids=_ids()).logits
    merged = exported.merge_and_unload()
    assert not any(isinstance(m, (Fp8Linear, peft.tuners.lora.LoraLayer)) for m in merged.modules())
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    torch.testing.assert_close(merged(input_ids=_ids()).logits, expected, atol=1e-5, rtol=1e-5,
                               msg="the merged model must compute what the exported adapters do")


def test_merge_works_at_fp8_compute_only() -> None:
    model = peft.get_peft_model(_llama(), _config())
    model, _ = amp8.initialize(model, None, amp8.config.levels.FP8_COMPUTE_ONLY)
    layer = _lora_layers(model)[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05)
    expected = layer.base_layer.weight.detach() + layer.get_delta_weight("default")
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight.detach(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_lora_checkpoint_resumes_bit_for_bit(level: str) -> None:
    model, optimizer = _lora_model("lora-first", level)
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    resumed, resumed_optimizer = _lora_model("lora-first", level, seed=5)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    for run, opt in ((model, optimizer), (resumed, resumed_optimizer)):
        run(input_ids=_ids(2), labels=_ids(2)).loss.backward()
        opt.step()
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert_bitwise_equal(actual, expected)


def test_transformers_init_weights_leaves_fp8_layers_alone() -> None:
    """``Fp8Linear`` is not an ``nn.Linear``: transformers' ``_init_weights`` (which
    re-draws ``nn.Linear`` weights in place) does not write into amp8's storage."""
    model, _ = amp8.initialize(_llama(), None, "O3")
    layer = model.model.layers[0].self_attn.q_proj
    stored = layer.weight.detach().clone()
    model.apply(model._init_weights)
    assert_bitwise_equal(layer.weight.detach(), stored)


BF16_BYTES = 2.0
QLORA_NF4_BYTES = 0.5  # 4-bit NF4 weights, the QLoRA reference (before its quantization constants)


@pytest.mark.parametrize("level", LEVELS)
def test_bytes_per_frozen_base_parameter(level: str) -> None:
    model, optimizer = _lora_model("lora-first", level)
    model(input_ids=_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    report = amp8.report(model, optimizer)
    bases = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    numel = sum(m.weight.numel() for m in bases)
    measured = report.frozen_bytes_per_param(fp8_layers_only=True)
    if level == "O3":  # one byte per element and a float32 scale per row (rowwise recipe)
        expected = sum(m.weight.numel() + 4 * m.out_features for m in bases) / numel
        assert measured == pytest.approx(expected, abs=1e-12) and measured <= 1.1
        assert measured < BF16_BYTES / 1.8
    else:  # FP16 and one float32 scale per layer
        expected = sum(2 * m.weight.numel() + 4 for m in bases) / numel
        assert measured == pytest.approx(expected, abs=1e-12) and measured <= BF16_BYTES + 1e-3


def _adapter_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_adapter_gradients_on_an_fp8_base_hold_the_dense_floors(level: str) -> None:
    """The adapters' gradients on an amp8 base against those on the FP32 base with the
    same real weights: above the 17 dB floor of an Fp8Linear's weight gradient, with
    margin (measured: 24 dB and more at O1 and O2, 27 dB at O3, whose FP8 weights the
    reference holds exactly)."""
    model, _ = _lora_model("lora-first", level)
    with torch.no_grad():
        for layer in _lora_layers(model):
            layer.lora_B["default"].weight.normal_(0, 0.05)  # lora_A gets a gradient too
    reference = amp8.export(model)  # the same real weights, in float32 nn.Linear layers
    x = _ids(3)
    fp8, exact = _adapter_grads(model, x), _adapter_grads(reference, x)
    assert set(fp8) == set(exact) and len(fp8) == 2 * len(TARGETS)
    for name in exact:
        assert_sqnr_at_least(exact[name], fp8[name], 20.0)


@pytest.mark.parametrize("order", ORDERS)
def test_dora_on_a_scaled_base_is_refused_with_the_fix(order: str) -> None:
    """DoRA reads the base weight directly: on amp8's scaled storage it would read
    ``w * scale``; refused in either order, before initialize changes anything."""
    config = peft.LoraConfig(r=RANK, target_modules=TARGETS, use_dora=True)
    model = _llama()
    if order == "amp8-first":
        model, _ = amp8.initialize(model, None, "O1")
        with pytest.raises(ValueError, match=r"DoraLinearVariant.*plain LoRA"):
            peft.get_peft_model(model, amp8.nn.register_lora(config))
        return
    model = peft.get_peft_model(model, config)
    with pytest.raises(ValueError, match=r"DoraLinearVariant.*O1-compute"):
        amp8.initialize(model, None, "O3")
    assert not any(isinstance(m, Fp8Linear) for m in model.modules()), "a refused call changes nothing"


def test_an_init_that_rewrites_the_base_is_refused_on_an_amp8_base() -> None:
    model, _ = amp8.initialize(_llama(), None, "O2")
    config = peft.LoraConfig(r=RANK, target_modules=TARGETS, init_lora_weights="olora")
    with pytest.raises(ValueError, match=r"init_lora_weights='olora' rewrites the base weight"):
        peft.get_peft_model(model, amp8.nn.register_lora(config))


def test_saved_adapters_load_onto_an_amp8_base(tmp_path: Any) -> None:
    model, _ = _lora_model("amp8-first", "O3")
    with torch.no_grad():
        for layer in _lora_layers(model):
            layer.lora_B["default"].weight.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    base, _ = amp8.initialize(_llama(), None, "O3")
    config = amp8.nn.register_lora(peft.LoraConfig.from_pretrained(tmp_path))
    loaded = peft.PeftModel.from_pretrained(base, tmp_path, config=config)
    assert all(type(layer) is Fp8LoraLinear for layer in _lora_layers(loaded))
    assert_bitwise_equal(loaded(input_ids=_ids()).logits, model(input_ids=_ids()).logits)


def test_an_embedding_peft_adapts_stays_as_the_model_has_it() -> None:
    config = peft.LoraConfig(r=RANK, target_modules=["q_proj", "embed_tokens"])
    model, optimizer = amp8.initialize(peft.get_peft_model(_llama(), config), None, "O2")
    embedding = model.base_model.model.model.embed_tokens
    assert type(embedding.base_layer) is nn.Embedding and embedding.base_layer.weight.dtype == torch.float32
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer) is Fp8Linear
    rows = {row.name: row for row in amp8.report(model).rows}
    assert "PEFT adapts and merges into it" in rows["base_model.model.model.embed_tokens.base_layer.weight"].note
