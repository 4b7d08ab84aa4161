"""``LowBitEmbedding``: an embedding table in FP16 with its gradient in FP8 per row."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import LowBitEmbedding, SingleStoredWeightModule
from amp8.quant.scaling import sqnr
from conftest import assert_bitwise_equal, assert_sqnr_at_least, resume_from_checkpoint, train_steps

GRAD_SQNR_FLOOR_DB = {"E4M3": 28.0, "gradient": 22.0}
"""E4M3 with one scale per row measures 30-31 dB on Gaussian rows, E5M2 24-25 dB."""


def _zipf_ids(vocab: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Token ids with Zipf frequencies: row gradients differ by orders of magnitude."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    flat = torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True,
                             generator=torch.Generator().manual_seed(seed))
    return flat.view(shape)


class _Lookup(nn.Module):
    """An embedding and a linear read-out, the shape of a language model's ends."""

    def __init__(self, vocab: int = 96, dim: int = 32, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.out = nn.Linear(dim, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids))


@pytest.mark.parametrize("vocab, dim", [(50, 16), (300, 48)])
@pytest.mark.parametrize("grad_format", ["E4M3", "gradient"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_lookup_is_exact_and_gradient_is_close(vocab: int, dim: int, grad_format: str, padding_idx: int | None) -> None:
    reference = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    layer = LowBitEmbedding.from_embedding(copy.deepcopy(reference), amp8.Recipe(weight_grad_format=grad_format))
    table = layer.read_weight()
    with torch.no_grad():
        reference.weight.copy_(table)  # the FP16 table, so the lookups compare exactly
    ids = _zipf_ids(vocab, (4, 37))
    upstream = torch.randn(4, 37, dim)
    out = layer(ids)
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, reference(ids))
    (out * upstream).sum().backward()
    (reference(ids) * upstream).sum().backward()
    grad = layer.weight_grad
    assert grad is not None and grad.scale.shape == (vocab, 1)
    assert grad.dtype == layer.stored_weight.grad_dtype
    expected = reference.weight.grad
    real = grad.dequantize()
    looked_up = torch.zeros(vocab, dtype=torch.bool)
    looked_up[ids.flatten()] = True
    if padding_idx is not None:
        looked_up[padding_idx] = False
    assert (real[~looked_up] == 0).all(), "rows not looked up (and the padding row) must get no gradient"
    assert_sqnr_at_least(expected, real, GRAD_SQNR_FLOOR_DB[grad_format])
    # Per row: the rare tokens' rows are as precise as the frequent ones'.
    worst = min(sqnr(expected[row], real[row]) for row in torch.nonzero(looked_up).flatten().tolist())
    assert worst >= GRAD_SQNR_FLOOR_DB[grad_format] - 6.0, f"worst row {worst:.1f} dB"


def test_gradients_accumulate_over_backward_passes() -> None:
    reference = nn.Embedding(64, 32)
    layer = LowBitEmbedding.from_embedding(copy.deepcopy(reference), amp8.Recipe())
    with torch.no_grad():
        reference.weight.copy_(layer.read_weight())
    for seed in range(3):
        ids = _zipf_ids(64, (8, 16), seed)
        upstream = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(seed))
        (layer(ids) * upstream).sum().backward()
        (reference(ids) * upstream).sum().backward()
    assert_sqnr_at_least(reference.weight.grad, layer.weight_grad.dequantize(), 26.0)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_initialize_stores_untied_tables_and_keeps_the_others(level: str) -> None:
    model = nn.ModuleDict({
        "plain": nn.Embedding(40, 16),
        "renormalized": nn.Embedding(40, 16, max_norm=1.0),
        "sparse": nn.Embedding(40, 16, sparse=True),
        "tied": nn.Embedding(40, 16),
        "head": nn.Linear(16, 40, bias=False),
        "proj": nn.Linear(16, 16),
    })
    model["head"].weight = model["tied"].weight
    model, _ = amp8.initialize(model, torch.optim.Adam(model.parameters()), level, layer_selection="all", recipe=amp8.Recipe())
    assert isinstance(model["plain"], LowBitEmbedding)
    assert model["plain"].weight_dtype == torch.float16 and model["plain"].weight.dtype == torch.float32
    for name in ("renormalized", "sparse", "tied"):
        assert type(model[name]) is nn.Embedding, name
    notes = {row.name: row.note for row in amp8.report(model).rows}
    assert "max_norm" in notes["renormalized.weight"]
    assert "sparse" in notes["sparse.weight"]
    assert "shared" in notes["tied.weight"]
    assert "FP16 table" in notes["plain.weight"]
    first = amp8.report(model).highlights()[0]
    assert first.endswith("FP16 tables with FP8 gradients: plain.weight"), first
    assert "renormalized.weight" in first.split("; FP16 tables")[0]


def test_compute_only_and_o0_leave_embeddings_alone() -> None:
    for level in ("O0", amp8.config.levels.FP8_COMPUTE_ONLY):
        model, _ = amp8.initialize(_Lookup(), None, level, layer_selection="all", recipe=amp8.Recipe())
        assert type(model.embedding) is nn.Embedding


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_training_steps_resume_exactly(level: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _Lookup()
        return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, layer_selection="all", recipe=amp8.Recipe())

    batches = [_zipf_ids(96, (8, 16), seed) for seed in range(4)]
    model, optimizer = build()
    before = model.embedding.read_weight()
    train_steps(model, optimizer, batches[:2])
    assert not torch.equal(model.embedding.read_weight(), before), "the optimizer must update the table"
    state = optimizer.state[model.embedding.weight]
    assert "master" not in state, "a low-bit table keeps FP16 at every level, with no master weight"
    resumed_model, resumed_optimizer = resume_from_checkpoint(build, model, optimizer)
    assert train_steps(model, optimizer, batches[2:]) == train_steps(resumed_model, resumed_optimizer, batches[2:])
    assert_bitwise_equal(resumed_model.embedding.weight, model.embedding.weight)
    assert_bitwise_equal(resumed_model.embedding.weight_scale, model.embedding.weight_scale)


def test_o2_table_bytes_follow_the_level() -> None:
    model = _Lookup(vocab=512, dim=64)
    model, optimizer = amp8.initialize(model, torch.optim.Adam(model.parameters()), "O2", layer_selection="all", recipe=amp8.Recipe())
    train_steps(model, optimizer, [_zipf_ids(512, (8, 16))])
    model(_zipf_ids(512, (8, 16))).pow(2).mean().backward()  # a gradient in place, as at the peak
    row = next(row for row in amp8.report(model, optimizer).rows if row.name == "embedding.weight")
    assert (row.weight, row.grad, row.exp_avg, row.exp_avg_sq) == ("float16", "float8_e4m3fn",
                                                                  "float8_e4m3fn", "float16")
    # 2 + 1 + 1 + 2 bytes, and the scales: one per row for the gradient and both moments.
    assert 6.0 < row.bytes / row.numel <= 6.0 + 3 * 4 / 64 + 0.01


def test_plain_checkpoint_loads_and_export_gives_a_plain_table() -> None:
    plain = _Lookup()
    model, _ = amp8.initialize(copy.deepcopy(plain), None, "O2", layer_selection="all", recipe=amp8.Recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain form is what a model's state_dict() gives: no conversion
        model.load_state_dict(plain.state_dict())
    assert_bitwise_equal(model.embedding.read_weight(), plain.embedding.weight.half().float())
    exported = amp8.export(model)
    assert type(exported.embedding) is nn.Embedding
    assert_bitwise_equal(exported.embedding.weight.detach(), model.embedding.read_weight())
    ids = _zipf_ids(96, (2, 5))
    assert_bitwise_equal(exported.embedding(ids), model.embedding(ids).detach())


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_lookup_keeps_its_gradient(dtype: torch.dtype) -> None:
    """Traced by Dynamo (its ``eager`` backend runs the captured graph as it is), the
    lookup hands on the same FP8 table gradient as eager code, whether its rows need a
    cast to the model's dtype or not (torch 2.11's Dynamo lost the gradient of a Function
    whose output is a cast to the dtype it already has)."""
    model, _ = amp8.initialize(_Lookup().to(dtype), None, "O2", layer_selection="all")
    compiled = copy.deepcopy(model)
    compiled.embedding.compile(backend="eager")
    ids = _zipf_ids(96, (4, 16))
    for candidate in (model, compiled):
        candidate(ids).float().pow(2).mean().backward()
    expected, got = model.embedding.weight_grad.dequantize(), compiled.embedding.weight_grad.dequantize()
    assert expected.abs().sum() > 0
    assert_bitwise_equal(got, expected)


@pytest.mark.compile
def test_copies_and_compiled_forward_agree() -> None:
    model, _ = amp8.initialize(_Lookup(), None, "O2", layer_selection="all", recipe=amp8.Recipe())
    ids = _zipf_ids(96, (4, 16))
    copied = copy.deepcopy(model)
    compiled = copy.deepcopy(model)
    compiled.embedding.compile()
    results = []
    for candidate in (model, copied, compiled):
        candidate(ids).pow(2).mean().backward()
        results.append(candidate.embedding.weight_grad)
    for other in results[1:]:
        assert_bitwise_equal(other.data.view(torch.uint8), results[0].data.view(torch.uint8))
        assert_bitwise_equal(other.scale, results[0].scale)
    assert all(isinstance(candidate.embedding, SingleStoredWeightModule) for candidate in (copied, compiled))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_follow_the_model_dtype_and_the_table_keeps_its_storage(dtype: torch.dtype) -> None:
    model, _ = amp8.initialize(_Lookup(), None, "O2", layer_selection="all", recipe=amp8.Recipe())
    table = model.embedding.read_weight()
    model.to(dtype)
    ids = _zipf_ids(96, (2, 8))
    assert model.embedding.weight_dtype == torch.float16 and model.embedding.weight_scale.dtype == torch.float32
    assert model.embedding.weight.dtype == dtype, "the table reports the dtype the model was cast to"
    assert_bitwise_equal(model.embedding.read_weight(), table)
    assert model.embedding(ids).dtype == dtype
    model.float()
    assert model.embedding(ids).dtype == torch.float32


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_backward_casts_the_gradient_as_the_handle_re_stores_a_sum(margin: int, power_of_2: bool) -> None:
    """Backward's FP8 cast and ``StoredWeight.quantize_grad`` (gradient accumulation)
    follow one rule: the recipe's format, margin and power-of-two scales, per row."""
    recipe = amp8.Recipe(margin=margin, power_of_2_scales=power_of_2)
    layer = LowBitEmbedding.from_embedding(nn.Embedding(64, 32), recipe)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40]  # each row once: exact sums
    upstream = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)) * torch.logspace(-6, 0, 40)[:, None]
    (layer(ids) * upstream).sum().backward()
    expected = torch.zeros(64, 32)
    expected[ids] = upstream
    data, scale = layer.stored_weight.quantize_grad(expected)
    assert_bitwise_equal(layer.weight_grad.data.view(torch.uint8), data.view(torch.uint8))
    assert_bitwise_equal(layer.weight_grad.scale, scale)
