"""One owner per weight: every write of an FP8 layer's weight lands in its storage, its
scales and, at O3, the optimizer's master weight, whichever path it takes (the write
paths are found from each operation's schema, tested here over a table of operations),
and torch's own weight utilities work on it or fail naming a fix that works."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import amp8
from amp8.nn import Fp8Linear
from conftest import assert_sqnr_at_least, mlp

LEVELS = ["O1", "O2", "O3"]
# What the storage keeps of a written value: FP16 (O1, O2) or FP8 (O3) with fresh scales.
SQNR_FLOOR_DB = {"O1": 55.0, "O2": 55.0, "O3": 25.0}

Write = Callable[[torch.Tensor, torch.Tensor], None]
# name -> (the write on the weight ``w`` with a new value ``t`` of its shape, the real
# weight torch gives a plain weight ``w0`` for the same write)
WRITES: dict[str, tuple[Write, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    "copy_": (lambda w, t: w.copy_(t), lambda w0, t: t),
    "data =": (lambda w, t: setattr(w, "data", t), lambda w0, t: t),
    "add_": (lambda w, t: w.add_(t, alpha=0.5), lambda w0, t: w0 + 0.5 * t),
    "out= other": (lambda w, t: torch.add(t, 1.0, out=w), lambda w0, t: t + 1.0),
    "out= self": (lambda w, t: torch.mul(w, 2.0, out=w), lambda w0, t: 2.0 * w0),
    "out= clamp": (lambda w, t: torch.clamp(w, -0.05, 0.05, out=w), lambda w0, t: w0.clamp(-0.05, 0.05)),
    "addcmul_": (lambda w, t: w.addcmul_(t, t, value=0.1), lambda w0, t: w0 + 0.1 * t * t),
    "lerp_ with a weight": (lambda w, t: w.lerp_(t, 0.25), lambda w0, t: w0.lerp(t, 0.25)),
    "row mul_": (lambda w, t: w[3].mul_(4.0), lambda w0, t: torch.cat([w0[:3], 4 * w0[3:4], w0[4:]])),
    "column index_put_": (
        lambda w, t: w.__setitem__((slice(None), 2), 0.0), lambda w0, t: w0 * (torch.arange(w0.shape[1]) != 2)
    ),
    "transposed view copy_": (lambda w, t: w.t().copy_(t.t()), lambda w0, t: t),
    "foreach add_": (lambda w, t: torch._foreach_add_([w], [t]), lambda w0, t: w0 + t),
    "foreach lerp_": (lambda w, t: torch._foreach_lerp_([w], [t], 0.5), lambda w0, t: 0.5 * (w0 + t)),
    "foreach mul_ scalar list": (lambda w, t: torch._foreach_mul_([w], [3.0]), lambda w0, t: 3.0 * w0),
    "init.constant_": (lambda w, t: nn.init.constant_(w, 0.125), lambda w0, t: torch.full_like(w0, 0.125)),
    "init.zeros_": (lambda w, t: nn.init.zeros_(w), lambda w0, t: torch.zeros_like(w0)),
}


def _assert_stored(expected: torch.Tensor, actual: torch.Tensor, level: str) -> None:
    """``actual`` holds ``expected`` as the level's storage can: exactly where it is all
    zeros, else within the storage's SQNR floor."""
    if not expected.any():
        assert not actual.any(), "zeros store exactly"
        return
    assert_sqnr_at_least(expected, actual, SQNR_FLOOR_DB[level])


def _initialized(level: str, lr: float = 1e-3, model: nn.Module | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(32, 64, 32) if model is None else model
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), level)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 1) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("level", LEVELS)
def test_a_write_lands_in_the_weight_and_the_layer_computes_with_it(level: str, write: str) -> None:
    model, _ = _initialized(level)
    layer = model[0]
    x = torch.randn(16, 32)
    layer(x)  # the layer holds its FP8 casts of the old weight now
    apply, expected_of = WRITES[write]
    w0, t = layer.weight.float().clone(), 0.1 * torch.randn(64, 32)
    expected = expected_of(w0, t)
    with torch.no_grad():
        apply(layer.weight, t)
    assert not torch.equal(expected, w0), "the table's write changes the weight"
    _assert_stored(expected, layer.weight.float(), level)
    # The FP8 GEMM reads the new weight, not a cast of the old one (FP8 input too: a lower floor).
    reference = torch.nn.functional.linear(x, expected, layer.bias.detach())
    assert_sqnr_at_least(reference, layer(x).detach(), 18.0)


@pytest.mark.parametrize("write", ["copy_", "data =", "out= other", "add_", "foreach add_", "init.constant_"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_written_weight_is_where_the_next_step_starts(level: str, write: str) -> None:
    """At O3 the optimizer's master weight takes what was written: a step of a tiny
    learning rate leaves the weight at the written value, not at the old one."""
    model, optimizer = _initialized(level, lr=1e-7)
    _step(model, optimizer)  # the update groups hold the weights in their buffers
    apply, expected_of = WRITES[write]
    w0, t = model[0].weight.float().clone(), 0.1 * torch.randn(64, 32)
    expected = expected_of(w0, t)
    with torch.no_grad():
        apply(model[0].weight, t)
    _step(model, optimizer, seed=2)
    _assert_stored(expected, model[0].weight.float(), level)


@pytest.mark.parametrize("form", ["plain", "compact"])
@pytest.mark.parametrize("level", LEVELS)
def test_weights_loaded_after_initialize_are_fine_tuned_from(level: str, form: str) -> None:
    """The fine-tuning order: initialize, load pretrained weights, train."""
    model, optimizer = _initialized(level, lr=1e-7)
    pretrained = mlp(32, 64, 32, seed=7)
    if form == "compact":
        source, _ = amp8.initialize(pretrained, None, level)
        with amp8.compact_state_dict(source):
            state = source.state_dict()
        reference = source[0].weight.float().clone()
    else:
        state, reference = pretrained.state_dict(), pretrained[0].weight.detach().clone()
    model.load_state_dict(state)
    _step(model, optimizer)
    assert_sqnr_at_least(reference, model[0].weight.float(), SQNR_FLOOR_DB[level])


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train_llama(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_mlp(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        _step(model, optimizer, seed=10 + step)


@pytest.mark.parametrize("family", ["mlp", "llama"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_ema_of_an_amp8_model_is_the_ema_of_its_weights(level: str, family: str) -> None:
    """torch's AveragedModel copies every buffer from the model after averaging the
    Parameters: a weight's scales are no buffer, so they stay with their weight."""
    build, train = (_llama, _train_llama) if family == "llama" else (lambda: mlp(32, 64, 32), _train_mlp)
    model, optimizer = _initialized(level, lr=1e-2, model=build())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)
    before = {name: p.float().clone() for name, p in model.named_parameters()}
    train(model, optimizer, 3)
    ema.update_parameters(model)
    averaged = dict(ema.module.named_parameters())
    for name, param in model.named_parameters():
        expected = 0.9 * before[name] + 0.1 * param.float()
        assert_sqnr_at_least(expected, averaged[name].float(), SQNR_FLOOR_DB[level] - 3)


# -- torch's utilities on weights ---------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_functional_call_computes_with_the_given_tensors(level: str) -> None:
    model, _ = _initialized(level)
    params = {name: torch.randn_like(p.float()) * 0.1 for name, p in model.named_parameters()}
    x = torch.randn(4, 32)
    plain = mlp(32, 64, 32)
    expected = torch.func.functional_call(plain, params, (x,))
    actual = torch.func.functional_call(model, params, (x,))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    # Gradients reach the given tensors (meta-learning, per-sample gradients).
    grads = torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)
    expected_grads = torch.func.grad(lambda p: torch.func.functional_call(plain, p, (x,)).sum())(params)
    for name in params:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_an_ensemble_runs_under_vmap_with_stack_module_state(level: str) -> None:
    models = [_initialized(level, model=mlp(32, 64, 32, seed=seed))[0] for seed in (0, 1, 2)]
    params, buffers = torch.func.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(4, 32)
    outputs = torch.vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,)), in_dims=(0, 0))(params, buffers)
    for index, model in enumerate(models):
        weights = {name: p.float() for name, p in model.named_parameters()}
        expected = torch.func.functional_call(mlp(32, 64, 32), weights, (x,))
        torch.testing.assert_close(outputs[index], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_a_detached_weight_converts_to_lists_and_numpy(level: str) -> None:
    weight = _initialized(level)[0][0].weight
    real = weight.float()
    assert torch.tensor(weight.detach().tolist()).equal(real)
    assert torch.from_numpy(weight.detach().numpy()).equal(real)
    assert torch.tensor(weight[1].tolist()).equal(real[1])
    with pytest.raises(RuntimeError, match="requires grad"):
        weight.numpy()


@pytest.mark.parametrize("level", LEVELS)
def test_a_copy_moves_to_meta(level: str) -> None:
    model, _ = _initialized(level)
    moved = copy.deepcopy(model).to("meta")
    assert moved[0].weight.device.type == "meta" and moved[0].weight_scale.device.type == "meta"
    assert model[0].weight.device.type == "cpu", "the original stays"
    _step(model, _initialized(level)[1])  # the original still trains (its own optimizer's params are others')


PARAMETRIZATIONS = {
    "weight_norm": torch.nn.utils.parametrizations.weight_norm,
    "spectral_norm": torch.nn.utils.parametrizations.spectral_norm,
    "orthogonal": torch.nn.utils.parametrizations.orthogonal,
}


@pytest.mark.parametrize("parametrization", list(PARAMETRIZATIONS))
@pytest.mark.parametrize("level", LEVELS)
def test_a_parametrization_after_initialize_names_the_order_that_works(level: str, parametrization: str) -> None:
    register = PARAMETRIZATIONS[parametrization]
    model, _ = _initialized(level, model=mlp(32, 32, 32))
    register(model[0])
    with pytest.raises(TypeError, match="register parametrizations .* before amp8.initialize"):
        model(torch.randn(4, 32))
    # The order the message names trains.
    model = mlp(32, 32, 32)
    register(model[0])
    model, optimizer = _initialized(level, model=model)
    before = model[0].weight.detach().clone()
    _step(model, optimizer)
    assert not torch.equal(model[0].weight.detach(), before)


@pytest.mark.parametrize("level", LEVELS)
def test_tying_after_initialize_names_the_order_that_works(level: str) -> None:
    model, _ = _initialized(level, model=mlp(32, 32, 32))
    model[2].weight = model[0].weight
    with pytest.raises(TypeError, match="tie weights before amp8.initialize"):
        model(torch.randn(4, 32))
    model = mlp(32, 32, 32)
    model[2].weight = model[0].weight
    model, optimizer = _initialized(level, model=model)
    _step(model, optimizer)
    assert model[2].weight is model[0].weight


def test_the_scales_are_no_buffer_and_the_compact_form_keeps_them() -> None:
    model, _ = _initialized("O3")
    assert not any(name.endswith("weight_scale") for name, _ in model.named_buffers())
    assert isinstance(model[0], Fp8Linear) and model[0].weight_scale is model[0].weight.stored().scale
    with amp8.compact_state_dict(model):
        state = model.state_dict()
    assert state["0.weight_scale"].equal(model[0].weight_scale)
    assert "0.weight_scale" not in model.state_dict(), "the plain form holds real values only"


@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_with_keep_vars_holds_the_parameters(level: str) -> None:
    model, _ = _initialized(level)
    state = model.state_dict(keep_vars=True)
    assert state["0.weight"] is model[0].weight and state["0.bias"] is model[0].bias


@pytest.mark.parametrize("level", LEVELS)
def test_a_pruned_layer_computes_with_the_masked_weight(level: str) -> None:
    prune = pytest.importorskip("torch.nn.utils.prune")
    model, _ = _initialized(level)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    x = torch.randn(4, 32)
    masked = model[0].weight_orig.float() * model[0].weight_mask
    assert (masked == 0).float().mean() >= 0.5
    expected = torch.nn.functional.linear(x, masked, model[0].bias.detach())
    torch.testing.assert_close(model[0](x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
def test_the_float32_values_of_an_init_chain_are_counted_until_the_next_forward(level: str) -> None:
    """A chain of in-place writes (what an init function runs: ``uniform_`` then ``mul_``)
    runs on float32 values kept beside the storage; the report's bytes show them until the
    layer next uses its weight, which drops them."""
    model, optimizer = _initialized(level)
    handle = model[0].stored_weight
    stored = handle.nbytes
    with torch.no_grad():
        model[0].weight.uniform_(-1.0, 1.0).mul_(0.1)
    assert handle.nbytes == stored + 4 * model[0].weight.numel()
    assert amp8.report(model, optimizer).rows[0].bytes >= handle.nbytes
    model(torch.randn(2, 32))
    assert handle.nbytes == stored
