"""Mixture-of-experts models through amp8.initialize: every experts module runs its GEMMs
in FP8 at every level, trains with LowBitAdam, shows in the report and exports back to
the model's own experts module. A tiny model of tests/moe_models.py in the fast tier;
Mixtral, Qwen3-MoE and DeepSeek-V3 from transformers in the integration tier."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import amp8
from amp8._compat import native_rowwise_scaled_mm
from amp8.nn import Fp8Experts, Fp8Linear
from amp8.tensor import stored_weight
from amp8.tensor.weight_grad import GradLayout, WeightGrad
from conftest import assert_checkpoint_round_trips
from moe_models import TinyExperts, TinyMoeBlock, tiny_moe_model

LEVELS = ["O1", "O2", "O3", "O1-compute"]
# What each level stores the experts' weights as (those of FP8 layers); O1-compute leaves them.
STORED_DTYPE = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float8_e4m3fn}
FP8_GEMMS = {"_scaled_mm"}
# The recipe whose GEMMs torch's FLOP counter sees as FP8 ops on this torch: rowwise, the
# default's granularity, where the CPU's torch._scaled_mm takes rowwise scales (torch
# 2.12+); before that amp8 computes a rowwise FP8 GEMM on the CPU as dequantize and one
# float32 matmul (the same bits), which the counter cannot tell from a high-precision one.
COUNTED_RECIPE = (
    amp8.Recipe.preset("rowwise") if native_rowwise_scaled_mm(torch.device("cpu")) else amp8.Recipe()
)


def _experts(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Experts)}


def fp8_share_of_expert_gemm_flops(model: nn.Module, forward: Callable[[], torch.Tensor]) -> float:
    """The share of the experts' GEMM FLOPs (forward and backward, every experts module
    of ``model``) that run in FP8: each module runs again, alone, on the inputs
    ``forward()`` gave it, under torch's FLOP counter."""
    captured: list[tuple[nn.Module, tuple]] = []
    hooks = [
        module.register_forward_pre_hook(lambda m, args: captured.append((m, args)))
        for module in _experts(model).values()
    ]
    with torch.no_grad():
        forward()
    for hook in hooks:
        hook.remove()
    assert captured, "the model ran no experts module"
    with FlopCounterMode(display=False) as counter:
        for module, (hidden, index, weights) in captured:
            module(hidden.detach().requires_grad_(True), index, weights).sum().backward()
    flops = counter.get_flop_counts()["Global"]
    fp8 = sum(count for op, count in flops.items() if str(op).split(".")[-1] in FP8_GEMMS)
    return fp8 / sum(flops.values())


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor], steps: int
) -> list[float]:
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        value = loss()
        value.backward()
        optimizer.step()
        losses.append(value.item())
    return losses


@pytest.mark.parametrize("level", LEVELS)
def test_initialize_runs_every_experts_module_in_fp8_at_every_level(level: str) -> None:
    model = tiny_moe_model()
    experts = model[1].experts
    params = {name: (p, p.dtype) for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp8.initialize(model, optimizer, level, recipe=COUNTED_RECIPE)
    swapped = model[1].experts
    assert isinstance(swapped, Fp8Experts) and isinstance(model[0], Fp8Linear)
    assert type(model[1].gate) is nn.Linear, "the router stays in high precision"
    for name in ("gate_up_proj", "down_proj"):
        assert getattr(swapped, name) is getattr(experts, name), "the user's Parameters are reused"
        handle = stored_weight(getattr(swapped, name))
        stored = params[f"1.experts.{name}"][1] if handle is None else handle.data.dtype
        assert stored == STORED_DTYPE.get(level, params[f"1.experts.{name}"][1])
    x, target = torch.randn(32, 32), torch.randn(32, 32)
    before = swapped.down_proj.detach().clone()
    losses = _train(model, optimizer, lambda: (model(x) - target).pow(2).mean(), 4)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert not torch.equal(swapped.down_proj.detach(), before), "the optimizer updates the experts"
    assert isinstance(swapped.down_proj.grad, WeightGrad) == (level in STORED_DTYPE)
    assert fp8_share_of_expert_gemm_flops(model, lambda: model(x)) >= 0.95


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_expert_weights_gradients_and_adam_state_take_scales_per_expert(recipe_name: str) -> None:
    model = tiny_moe_model()
    recipe = amp8.Recipe.preset(recipe_name)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", recipe=recipe)
    x = torch.randn(32, 32)
    _train(model, optimizer, lambda: model(x).pow(2).mean(), 2)
    experts = model[1].experts
    weight = experts.gate_up_proj  # (16 experts, 32, 32)
    assert stored_weight(weight).data.dtype == torch.float16 and experts.gate_up_proj_scale.shape == ()
    grad = weight.grad
    assert isinstance(grad, WeightGrad) and grad.fp8.dtype == torch.float8_e4m3fn
    per_expert = (16, 1, 1) if recipe_name == "tensorwise" else (16, 32, 1)
    assert tuple(grad.fp8.scale.shape) == per_expert
    state = optimizer.state[weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and tuple(state["exp_avg_scale"].shape) == (16, 32, 1)
    assert state["exp_avg_sq"].dtype == torch.float16
    rows = {row.name: row for row in amp8.report(model, optimizer).rows}
    row = rows["1.experts.gate_up_proj"]
    assert row.layer == "Fp8Experts" and row.fp8 and "scales per expert" in row.note
    assert row.weight == "float16" and row.grad == "float8_e4m3fn"
    assert "router of the experts '1.experts'" in rows["1.gate.weight"].note


def test_each_experts_gradient_scale_is_its_own() -> None:
    """The FP8 weight gradient of a stack of experts is each expert's own gradient
    quantized alone, bit for bit: one expert's large values move no other's scale."""
    model = tiny_moe_model()
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2", recipe=amp8.Recipe())
    layout = model[1].experts.stored_weights()[0].grad_layout
    value = torch.randn(16, 32, 32)
    value[3] *= 1e4
    stacked = layout.quantize(value)
    for e in range(16):
        alone = GradLayout(layout.dtype, None, 0, layout.margin, layout.power_of_2).quantize(value[e])
        assert torch.equal(stacked.data[e].view(torch.uint8), alone.data.view(torch.uint8))
        assert torch.equal(stacked.scale[e].reshape(()), alone.scale)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_moe_checkpoint_restores_exactly(level: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = tiny_moe_model()
        return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)

    model, optimizer = build()
    x = torch.randn(32, 32)
    _train(model, optimizer, lambda: model(x).pow(2).mean(), 2)
    resumed, resumed_optimizer = assert_checkpoint_round_trips(build, model, optimizer)
    runs = ((model, optimizer), (resumed, resumed_optimizer))
    losses = [_train(m, o, lambda m=m: m(x).pow(2).mean(), 2) for m, o in runs]
    assert losses[0] == losses[1], "training goes on identically after the resume"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_gives_the_models_own_experts_module_back(dtype: torch.dtype) -> None:
    model = tiny_moe_model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    exported = amp8.export(model, dtype=dtype)
    assert type(exported[1].experts) is TinyExperts and isinstance(model[1].experts, Fp8Experts)
    assert exported[1].experts.gate_up_proj.dtype == dtype
    real = model[1].experts.stored_weights()[1].read()
    assert torch.equal(exported[1].experts.down_proj.float(), real.to(dtype).float())
    assert list(exported.state_dict()) == list(tiny_moe_model().state_dict())


def test_initialize_keeps_experts_it_cannot_run_with_a_warning_and_refuses_a_second_call() -> None:
    model = tiny_moe_model()
    model[1].experts.is_transposed = True
    with pytest.warns(UserWarning, match="stay in high precision: is_transposed=True"):
        model, _ = amp8.initialize(model, None, "O1")
    assert type(model[1].experts) is TinyExperts
    model, _ = amp8.initialize(nn.Sequential(TinyMoeBlock()), None, "O1-compute")
    assert isinstance(model[0].experts, Fp8Experts) and type(model[0].gate) is nn.Linear
    with pytest.raises(ValueError, match="already initialized by amp8 .*Fp8Experts"):
        amp8.initialize(model, None, "O1")


# -- transformers' MoE models ------------------------------------------------------------

def _transformers_models() -> dict[str, Callable[[], nn.Module]]:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, max_position_embeddings=64)
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2,
        )),
        "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_key_value_heads=1,
            head_dim=16, num_experts=4, num_experts_per_tok=2,
        )),
        "deepseek-v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
            num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
            topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        )),
    }


@pytest.mark.integration
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_transformers_moe_models_train_with_fp8_experts(name: str, level: str) -> None:
    torch.manual_seed(0)
    model = _transformers_models()[name]()
    original = {fqn: type(m) for fqn, m in model.named_modules() if fqn.endswith(".experts")}
    assert original, "the model has experts modules"
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level,
                                       recipe=COUNTED_RECIPE.replace(output_head="high"))
    assert {fqn for fqn in _experts(model)} == set(original), "every experts module is swapped"
    ids = torch.randint(0, 64, (2, 16))
    losses = _train(model, optimizer, lambda: model(input_ids=ids, labels=ids).loss, 4)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert fp8_share_of_expert_gemm_flops(model, lambda: model(input_ids=ids).logits) >= 0.95
    amp8.report(model, optimizer)  # reads the experts' Parameters as it reads any other
    exported = amp8.export(model, optimizer)
    assert {fqn: type(exported.get_submodule(fqn)) for fqn in original} == original


def _width_128_models() -> dict[str, Callable[[], nn.Module]]:
    """The three families at width 128 (8 experts, 2 a token): small enough for the
    suite, wide enough that per-row scales weigh what they do in real models."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, max_position_embeddings=64,
                  num_hidden_layers=2)
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=256, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        )),
        "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=256, moe_intermediate_size=128, num_key_value_heads=2, head_dim=32,
            num_experts=8, num_experts_per_tok=2,
        )),
        "deepseek-v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, intermediate_size=256, moe_intermediate_size=128, first_k_dense_replace=1,
            num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
            topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
        )),
    }


@pytest.mark.integration
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "deepseek-v3"])
def test_a_whole_moe_model_at_o2_holds_at_most_6_5_bytes_per_parameter(name: str) -> None:
    torch.manual_seed(0)
    model = _width_128_models()[name]()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()  # the gradients count while they are held
    optimizer.step()
    report = amp8.report(model, optimizer)
    assert report.bytes_per_param <= 6.5, report.bytes_per_param
    assert report.fp8_share >= 0.9, "the experts count as FP8: their GEMMs run in FP8"


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_compiled_moe_model_trains_as_the_eager_one(level: str) -> None:
    """The experts run eagerly inside the compiled model (their routing is read on the
    host); the rest compiles, and training follows the eager run."""
    losses = []
    for compiled in (False, True):
        model = tiny_moe_model()
        model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
        run = torch.compile(model) if compiled else model
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
        losses.append(_train(run, optimizer, lambda run=run: run(x).pow(2).mean(), 3))
        assert isinstance(model[1].experts.gate_up_proj.grad, WeightGrad)
    assert losses[1] == pytest.approx(losses[0], rel=5e-3)
