"""GEMM layers found by what they compute: nn.Linear subclasses with Linear's math
(FalconLinear), Conv1D-like layers (GPT-2), and the ones kept in high precision with a
reason (other math, MultiheadAttention's out_proj)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D

import amp8
from amp8 import Recipe
from amp8.nn import Fp8Linear, swap_linear_layers
from amp8.nn.gemm_layers import GemmKind, gemm_features, gemm_kind, math_reason
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_sqnr_at_least

LEVELS = ["O1", "O2", "O3"]


class PlainSubclass(nn.Linear):
    """A subclass that keeps nn.Linear.forward: Linear's math without a probe."""


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * F.linear(x, self.weight, self.bias)


class ShiftedLinear(nn.Linear):
    """Other math that a zero weight would hide from a probe with the real weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + x.sum(-1, keepdim=True)


class TransposedLinear(nn.Linear):
    """Reads its weight the other way round: (in, out) math on a square (out, in) weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class NotConv1D(nn.Module):
    """Conv1D's structure, other math (x @ W^2): kept."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * self.weight) + self.bias


def _to_fp8(layer: nn.Module) -> Fp8Linear:
    return Fp8Linear.from_module(layer, Recipe())


@pytest.mark.parametrize(
    ("layer", "kind", "features"),
    [
        (nn.Linear(32, 48), GemmKind.LINEAR, (32, 48)),
        (FalconLinear(32, 48), GemmKind.LINEAR, (32, 48)),
        (Conv1D(48, 32), GemmKind.TRANSPOSED, (32, 48)),
        (NotConv1D(48, 32), GemmKind.TRANSPOSED, (32, 48)),
    ],
)
def test_gemm_kind_and_features_by_structure(layer: nn.Module, kind: GemmKind, features: tuple[int, int]) -> None:
    assert gemm_kind(layer) is kind
    assert gemm_features(layer) == features


@pytest.mark.parametrize("layer", [nn.LayerNorm(32), nn.Embedding(64, 32), nn.Conv1d(32, 32, 1), nn.Sequential()])
def test_other_modules_are_no_gemm_layers(layer: nn.Module) -> None:
    assert gemm_kind(layer) is None


@pytest.mark.parametrize("cls", [PlainSubclass, FalconLinear])
def test_subclasses_with_linear_math_pass(cls: type[nn.Linear]) -> None:
    assert math_reason(cls(32, 48)) is None


def test_conv1d_passes_the_probe() -> None:
    assert math_reason(Conv1D(48, 32)) is None


@pytest.mark.parametrize("cls", [ScaledLinear, ShiftedLinear, TransposedLinear])
def test_subclasses_with_other_math_are_kept_with_a_reason(cls: type[nn.Linear]) -> None:
    layer = cls(32, 32)
    with torch.no_grad():  # a zero weight must not hide the difference: the probe uses its own
        layer.weight.zero_()
        layer.bias.zero_()
    reason = math_reason(layer)
    assert reason is not None and reason.startswith(f"{cls.__name__} (an nn.Linear subclass) overrides forward")


def test_conv1d_like_with_other_math_is_kept() -> None:
    reason = math_reason(NotConv1D(48, 32))
    assert reason is not None and "x @ weight + bias" in reason


def test_probe_leaves_the_module_and_the_random_state_alone() -> None:
    layer = FalconLinear(32, 48)
    before = {name: value.clone() for name, value in layer.state_dict().items()}
    calls: list[int] = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    state = torch.random.get_rng_state()
    assert math_reason(layer) is None
    assert torch.equal(torch.random.get_rng_state(), state), "the probe must not move the global random state"
    assert calls == [], "the probe must not run the module's hooks"
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), f"the probe changed {name}"


def test_swap_takes_falcon_linear_and_conv1d_and_keeps_the_others() -> None:
    model = nn.ModuleDict({
        "falcon": FalconLinear(32, 48),
        "conv": Conv1D(48, 32),
        "scaled": ScaledLinear(32, 32),
        "not_conv": NotConv1D(48, 32),
        "attn": nn.MultiheadAttention(32, 2),
    })
    kept = swap_linear_layers(model, _to_fp8)
    assert isinstance(model["falcon"], Fp8Linear) and not model["falcon"].weight_transposed
    assert isinstance(model["conv"], Fp8Linear) and model["conv"].weight_transposed
    assert set(kept) == {"scaled", "not_conv", "attn.out_proj"}
    assert kept["scaled"].startswith("ScaledLinear (an nn.Linear subclass) overrides forward")
    assert "F.multi_head_attention_forward" in kept["attn.out_proj"]
    assert type(model["attn"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def _gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def _falcon() -> FalconForCausalLM:
    config = FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=False, bias=True,
    )
    return FalconForCausalLM(config)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    tokens = torch.randint(0, 128, (2, 16))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("build", [_gpt2, _falcon], ids=["gpt2", "falcon"])
def test_gpt2_and_falcon_blocks_run_in_fp8(level: str, build) -> None:
    model = build()
    keys = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    reference = build()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp8.initialize(model, optimizer, opt_level=level)
    fp8 = [name for name, module in model.named_modules() if isinstance(module, Fp8Linear)]
    assert len(fp8) == 8, f"every block GEMM (4 per block) must run in FP8, found {fp8}"
    saved = {key: tuple(value.shape) for key, value in model.state_dict().items() if key in keys}
    assert saved == keys, "the model's own checkpoint keys and shapes must stay"
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():  # eval: no dropout
        expected = reference.eval()(input_ids=tokens).logits
        got = model.eval()(input_ids=tokens).logits
    assert_sqnr_at_least(expected, got, 18.0)
    model.train()
    losses = [_step(model, optimizer) for _ in range(3)]
    assert all(torch.isfinite(loss) for loss in losses)
    grads = [m.weight.grad for m in model.modules() if isinstance(m, Fp8Linear)]
    assert all(g is None for g in grads), "zero_grad cleared the FP8 weight gradients"
    rows = {row.name: row for row in amp8.report(model, optimizer).rows}
    for name in fp8:
        row = rows[f"{name}.weight"]
        assert row.fp8 and row.note is None and list(row.shape) == list(keys[f"{name}.weight"]), row
        assert row.underflow is not None and row.saturated == 0.0, row


@pytest.mark.parametrize("level", LEVELS)
def test_gpt2_exports_to_its_own_conv1d_layers(level: str) -> None:
    model = _gpt2().eval()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level)
    tokens = torch.randint(0, 128, (2, 16))
    exported = amp8.export(model, optimizer)  # O3: the FP16 master weights
    conv = exported.transformer.h[0].attn.c_attn
    assert type(conv) is Conv1D and conv.weight.shape == (64, 192) and conv.weight.dtype == torch.float32
    with torch.no_grad():
        assert_sqnr_at_least(exported(input_ids=tokens).logits, model(input_ids=tokens).logits, 18.0)
    reloaded = _gpt2()
    reloaded.load_state_dict(exported.state_dict())  # a plain GPT-2 checkpoint again


def test_gpt2_conv1d_weight_grad_has_the_conv1d_shape() -> None:
    model = _gpt2()
    model, _ = amp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O2")
    tokens = torch.randint(0, 128, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    layer = model.transformer.h[0].mlp.c_fc
    assert isinstance(layer.weight.grad, WeightGrad) and layer.weight.grad.shape == (64, 256)


class LoraStyleLinear(nn.Linear):
    """loralib's layout: an nn.Linear subclass holding its adapter as its own Parameters,
    lora_B zero-initialized (a probe with those values alone would see Linear's math)."""

    def __init__(self, in_features: int, out_features: int, r: int = 4) -> None:
        super().__init__(in_features, out_features)
        self.lora_A = nn.Parameter(torch.randn(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + x @ self.lora_A.T @ self.lora_B.T


class WithChild(nn.Linear):
    """Keeps Linear's forward but holds a submodule: the swap would drop it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.norm = nn.LayerNorm(in_features)


@pytest.mark.parametrize(("layer", "named"), [(LoraStyleLinear(32, 32), "lora_A, lora_B"), (WithChild(32, 32), "norm")])
def test_subclasses_holding_more_than_weight_and_bias_are_kept(layer: nn.Linear, named: str) -> None:
    reason = math_reason(layer)
    assert reason is not None and f"holds other Parameters or submodules ({named})" in reason
    model = nn.ModuleDict({"layer": layer})
    assert set(swap_linear_layers(model, _to_fp8)) == {"layer"}
    assert model["layer"] is layer
