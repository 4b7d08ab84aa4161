"""amp8 inside the tools people already use: torch's zero_grad and clip_grad_norm_, any
optimizer where amp8 does not store the weights, autocast, dtype casts, and the user's own
DistributedDataParallel (apex's order, registered with amp8.distributed.register_ddp) with
amp8's FP8 comm hook."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp8
from amp8.distributed import DataParallelGroup, fp8_compress_hook
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal, assert_sqnr_at_least, compact_state, mlp
from multiprocess import run

LEVELS = ["O1", "O2", "O3"]


def _initialized(level: str, lr: float = 1e-3, preset: str = "tensorwise") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(32, 64, 16)
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), level, recipe=amp8.Recipe.preset(preset))


def _backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()


@pytest.mark.parametrize("level", LEVELS)
def test_model_zero_grad_clears_fp8_gradients(level: str) -> None:
    model, _ = _initialized(level)
    fresh = copy.deepcopy(model)
    _backward(model, seed=1)
    assert isinstance(model[0].weight.grad, WeightGrad)
    model.zero_grad()
    assert model[0].weight.grad is None and model[0].weight_grad is None
    _backward(model, seed=2)
    _backward(fresh, seed=2)
    assert_bitwise_equal(model[0].weight_grad.data, fresh[0].weight_grad.data)
    assert_bitwise_equal(model[0].weight_grad.scale, fresh[0].weight_grad.scale)


def test_zero_grad_without_set_to_none_zeroes_fp8_gradients() -> None:
    model, optimizer = _initialized("O2")
    _backward(model, seed=1)
    optimizer.zero_grad(set_to_none=False)
    assert model[0].weight.grad is not None
    assert not model[0].weight_grad.dequantize().any(), "zero_grad(set_to_none=False) must zero"
    model.zero_grad(set_to_none=False)
    assert not model[0].weight_grad.dequantize().any()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_grad_norm_counts_and_clips_fp8_gradients(level: str, norm_type: float) -> None:
    model, _ = _initialized(level)
    _backward(model, seed=1)
    twin = copy.deepcopy(model)
    _backward(twin, seed=1)
    expected = amp8.clip_grad_norm_(twin, max_norm=1e-3, norm_type=norm_type)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3, norm_type=norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    real = [model[0].weight_grad.dequantize(), model[2].weight_grad.dequantize(), model[0].bias.grad]
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in real]), norm_type)
    assert float(after) <= 1e-3 * (1 + 1e-5), f"the FP8 gradients were not clipped: norm {float(after)}"
    # The same clip up to float32 rounding of the coefficient; the FP8 data is untouched.
    torch.testing.assert_close(model[0].weight_grad.scale, twin[0].weight_grad.scale, rtol=1e-6, atol=0)
    assert_bitwise_equal(model[0].weight_grad.data, twin[0].weight_grad.data)


def test_any_optimizer_at_o0_is_returned_unchanged() -> None:
    model = mlp(32, 64, 16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert amp8.initialize(model, sgd, "O0", recipe=amp8.Recipe()) == (model, sgd)


def test_sgd_at_o1_is_refused_with_what_is_supported() -> None:
    model = mlp(32, 64, 16)
    with pytest.raises(TypeError, match=r"supports torch\.optim\.Adam, torch\.optim\.AdamW"):
        amp8.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", recipe=amp8.Recipe())


def test_fp8_compute_only_trains_with_sgd_and_plain_gradients() -> None:
    reference = mlp(32, 64, 16)
    model = mlp(32, 64, 16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp8.initialize(model, sgd, amp8.config.levels.FP8_COMPUTE_ONLY, recipe=amp8.Recipe())
    assert optimizer is sgd and isinstance(model[0], amp8.nn.Fp8Linear)
    x = torch.randn(8, 32)
    assert_sqnr_at_least(reference(x), model(x), 18.0)
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    grad = model[0].weight.grad
    assert type(grad) is torch.Tensor and grad.dtype == torch.float32
    assert_sqnr_at_least(reference[0].weight.grad, grad, 17.0)
    before = model[0].weight.detach().clone()
    optimizer.step()
    assert_bitwise_equal(model[0].weight.detach(), torch.add(before, grad, alpha=-0.1))
    row = amp8.report(model).rows[0]
    assert (row.weight, row.grad) == ("float32", "float32") and row.note.startswith("FP8 compute only")


@pytest.mark.parametrize("level", ["O1", "O2"])  # O3's masters need initialize's FP16 weights
def test_hand_built_low_bit_adam_finds_the_fp8_weights(level: str) -> None:
    managed, optimizer = _initialized(level, lr=1e-2)
    built, _ = amp8.initialize(mlp(32, 64, 16), None, level, recipe=amp8.Recipe())
    hand_built = amp8.optim.LowBitAdam(built.parameters(), lr=1e-2, level=level, decoupled_weight_decay=True,
                                       weight_decay=optimizer.defaults["weight_decay"])
    for model, opt in ((managed, optimizer), (built, hand_built)):
        for step in range(3):
            opt.zero_grad()
            _backward(model, seed=step)
            opt.step()
    for name, value in compact_state(managed).items():
        assert torch.equal(compact_state(built)[name], value), name
    assert not torch.equal(managed[0].read_weight(), mlp(32, 64, 16)[0].weight.detach()), "FP8 weights must move"


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_torch_optimizer_over_fp8_weights_fails_loudly(optimizer_class: type) -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, "O1", recipe=amp8.Recipe())
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    _backward(model, seed=0)
    with pytest.raises(TypeError, match="amp8.initialize returns"):
        optimizer.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O1-compute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_output_dtype_is_autocasts(level: str, dtype: torch.dtype) -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, level, recipe=amp8.Recipe())
    with torch.autocast("cpu", dtype=dtype):
        assert model[0](torch.randn(4, 32)).dtype == dtype


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_float16"])
def test_dtype_cast_keeps_fp8_layers_exact(level: str, cast: str) -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, level, recipe=amp8.Recipe())
    weight, scale = model[0].read_weight(), model[0].weight_scale.clone()
    stored_dtype = model[0].weight_dtype
    model = model.to(torch.float16) if cast == "to_float16" else getattr(model, cast)()
    assert model[0].weight_scale.dtype == torch.float32 and model[0].weight_dtype == stored_dtype
    assert model[0].weight.dtype == model[0].bias.dtype, "the weight reports the dtype the model was cast to"
    assert_bitwise_equal(model[0].weight_scale, scale)
    assert_bitwise_equal(model[0].read_weight(), weight)
    out = model(torch.randn(4, 32).to(model[0].bias.dtype))
    assert torch.isfinite(out).all()


def test_replaced_weight_is_refused_with_the_supported_order() -> None:
    model, _ = amp8.initialize(mlp(32, 64, 16), None, "O1", recipe=amp8.Recipe())
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(RuntimeError, match="replaced after amp8.initialize .*assigning a new Parameter.*copy_"):
        model(torch.randn(2, 32))


# -- the user's DistributedDataParallel, apex's order ------------------------------------
STEPS = 20


def _train_data_parallel(rank: int, world: int, level: str, wrap: str, preset: str = "tensorwise") -> dict:
    model, optimizer = _initialized(level, lr=1e-2, preset=preset)
    ddp = None
    if wrap == "ddp":
        ddp = amp8.distributed.register_ddp(nn.parallel.DistributedDataParallel(model))
    runner = ddp if ddp is not None else model
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(8, 32, generator=generator)
        loss = (runner(x) - torch.sin(3 * x[:, :16])).pow(2).mean()  # does not vanish in 20 steps
        loss.backward()
        if ddp is None:
            optimizer.synchronize()  # amp8's own data parallel averages at step() otherwise
        # Clipping right after backward, as trainers do: every rank must see averaged
        # gradients (FP8 ones included), or ranks clip by different factors and drift apart.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        losses.append(float(loss))
    stats = amp8.distributed.data_parallel_group(model).stats
    return {
        "state": {k: v.clone() for k, v in compact_state(model).items()},
        "losses": losses,
        "bytes": dict(stats.bytes_by_kind),
        "hooked": ddp is not None and bool(ddp._comm_hooks),
    }


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = {}
    for level in ("O1", "O2"):
        for wrap in ("ddp", "amp8"):
            folder = tmp_path_factory.mktemp(f"{level}-{wrap}")
            results[level, wrap] = run(_train_data_parallel, folder, level, wrap)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_after_initialize_trains_with_identical_ranks(ddp_results: dict, level: str) -> None:
    first, second = ddp_results[level, "ddp"]
    assert first["hooked"], "amp8 must register its FP8 comm hook on the user's DDP"
    for key, value in first["state"].items():
        if not key.endswith(("scale", "amax_history")) or key.endswith("weight_scale"):
            assert torch.equal(second["state"][key], value), key  # not each rank's last cast
    # The two reductions round differently, and stochastic rounding turns that into other
    # noise: compare the last five steps' mean (measured 0.19 % apart at O1, 0.21 % at O2) rather than one step
    # (0.5 % apart at O1).
    managed, final = (sum(run["losses"][-5:]) / 5 for run in (ddp_results[level, "amp8"][0], first))
    assert abs(final - managed) <= 0.005 * abs(managed), f"{final} vs amp8's own data parallel {managed}"


@pytest.mark.multiprocess
def test_ddp_after_initialize_under_nvfp4(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The comm hook reduces NVFP4's weight gradients (E4M3 at 16 x 16 tiles, from
    rotated and stochastically rounded FP4 operands) like any others."""
    results = {wrap: run(_train_data_parallel, tmp_path_factory.mktemp(f"nvfp4-{wrap}"), "O2", wrap, "nvfp4")
               for wrap in ("ddp", "amp8")}
    first, second = results["ddp"]
    assert first["hooked"]
    for key, value in first["state"].items():
        if not key.endswith(("scale", "amax_history")) or key.endswith("weight_scale"):
            assert torch.equal(second["state"][key], value), key
    # The two reductions round differently and stochastic rounding turns that into different
    # noise: single steps measured up to 3.6 % apart, so compare the last five steps' mean
    # (measured 0.88 % apart; 0.77 % when torch's clipping rounded the FP8 gradients' norms
    # to float16, which it no longer does since their Parameters report float32).
    managed, final = (sum(run["losses"][-5:]) / 5 for run in (results["amp8"][0], first))
    assert abs(final - managed) <= 0.015 * abs(managed), f"{final} vs amp8's own data parallel {managed}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_after_initialize_sends_every_gradient_in_fp8(ddp_results: dict, level: str) -> None:
    """Each gradient element crosses the wire in one byte: the all-to-all sends this
    rank's half of every gradient, the all-gather the half it owns back (FP8 weights by
    amp8's buckets, the rest by the comm hook), plus scales and a few flags."""
    numel = sum(p.numel() for p in mlp(32, 64, 16).parameters())
    sent = ddp_results[level, "ddp"][0]["bytes"]
    per_step = numel // 2
    for kind in ("all_to_all", "all_gather"):
        assert per_step * STEPS <= sent[kind] <= (per_step + 64) * STEPS, (kind, sent)


def _hook_on_plain_ddp(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    hooked = nn.Linear(64, 64)
    plain = copy.deepcopy(hooked)
    ddp = nn.parallel.DistributedDataParallel(hooked)
    state = DataParallelGroup()
    ddp.register_comm_hook(state, fp8_compress_hook)
    ddp_plain = nn.parallel.DistributedDataParallel(plain)  # FP32 all-reduce: the reference
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    ddp(x).pow(2).sum().backward()
    ddp_plain(x).pow(2).sum().backward()
    return {"grad": hooked.weight.grad.clone(), "expected": plain.weight.grad.clone(),
            "bytes": dict(state.stats.bytes_by_kind)}


@pytest.mark.multiprocess
def test_fp8_compress_hook_on_any_ddp_model(tmp_path) -> None:
    results = run(_hook_on_plain_ddp, tmp_path)
    assert_bitwise_equal(results[0]["grad"], results[1]["grad"])
    assert_sqnr_at_least(results[0]["expected"], results[0]["grad"], 25.0)
    numel = 64 * 64 + 64
    assert numel // 2 <= results[0]["bytes"]["all_to_all"] <= numel // 2 + 64


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(32, 64, 16)
        self.unused = nn.Linear(16, 16)  # an FP8 layer that gets no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ddp_options_and_no_sync(rank: int, world: int) -> dict:
    """Accumulate two micro-batches, the first inside DDP's ``no_sync()``, with
    ``find_unused_parameters=True`` and a layer that gets no gradient."""
    model = _WithUnusedHead()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", recipe=amp8.Recipe())
    ddp = amp8.distributed.register_ddp(nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))
    stats = amp8.distributed.data_parallel_group(model).stats
    generator = torch.Generator().manual_seed(7 + rank)
    inside_no_sync = []
    for _ in range(3):
        optimizer.zero_grad()
        before = stats.total
        with ddp.no_sync():
            ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
        inside_no_sync.append(stats.total - before)
        ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    state = {k: v.clone() for k, v in compact_state(model).items() if not k.endswith(("scale", "amax_history"))}
    return {"state": state, "inside_no_sync": inside_no_sync, "unused_grad": model.unused.weight.grad}


@pytest.mark.multiprocess
def test_ddp_no_sync_and_find_unused_parameters_keep_their_meaning(tmp_path) -> None:
    first, second = run(_ddp_options_and_no_sync, tmp_path)
    assert first["inside_no_sync"] == [0, 0, 0], "nothing may cross the wire inside no_sync()"
    assert first["unused_grad"] is None
    for key, value in first["state"].items():
        assert torch.equal(second["state"][key], value), key


class _LayerDrop(nn.Module):
    """A body and an FP8 block that a rank may skip (LayerDrop, MoE routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(32, 64, 16)
        self.block = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        hidden = self.body(x)
        return hidden if skip else hidden + self.block(hidden)


def _ddp_skipped_branch(rank: int, world: int) -> dict:
    """Each step one rank skips the block; ``find_unused_parameters=True``."""
    model = _LayerDrop()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    ddp = amp8.distributed.register_ddp(nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))
    generator = torch.Generator().manual_seed(11 + rank)
    block_grads = []
    for step in range(4):
        optimizer.zero_grad()
        ddp(torch.randn(8, 32, generator=generator), skip=(step + rank) % 2 == 1).pow(2).mean().backward()
        block_grads.append(model.block.weight_grad.dequantize().clone())  # averaged when backward ends
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
    state = {k: v.clone() for k, v in compact_state(model).items() if not k.endswith(("scale", "amax_history"))}
    return {"state": state, "block_grads": block_grads}


@pytest.mark.multiprocess
def test_ddp_find_unused_parameters_covers_fp8_weights_a_rank_skips(tmp_path) -> None:
    """A rank that skips an FP8 block reduces a zero gradient for it, as DDP does for its
    own parameters: no rank waits for the other, and both step alike."""
    first, second = run(_ddp_skipped_branch, tmp_path, timeout_s=120)
    for mine, theirs in zip(first["block_grads"], second["block_grads"]):
        assert_bitwise_equal(mine, theirs)
        assert mine.abs().amax() > 0, "the rank that used the block gives it a gradient"
    for key, value in first["state"].items():
        assert torch.equal(second["state"][key], value), key
