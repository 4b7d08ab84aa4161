"""torch.compile of amp8 models: one graph (``fullgraph=True``), eager numerics.

Two backends: ``aot_eager`` captures forward and backward as graphs and runs them with
eager kernels, so any difference from eager is a capture bug and the check is bitwise;
Inductor generates its own kernels (C++ on the CPU, Triton on CUDA) and may reorder
float32 reductions (LayerNorm, GELU's backward, bias gradients), which now and then
moves an FP8 rounding: its check is an SQNR floor of 40 dB on every output, gradient and
weight (measured on the CPU: 51.7 dB at worst, most of them bit for bit).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import amp8
import multiprocess
from amp8 import _compat
from amp8.nn import Fp8Linear, wgrad
from amp8.nn.outlier_split import split_outlier_tokens
from amp8.tensor.weight_grad import WeightGrad
from conftest import assert_bitwise_equal, assert_sqnr_at_least

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def fresh_compiler() -> None:
    """Each test compiles from scratch: earlier tests' graphs must not count towards
    Dynamo's recompile limit, nor be reused."""
    torch._dynamo.reset()


CASES = {
    "O1-tensorwise": ("O1", amp8.Recipe()),
    "O2-rowwise": ("O2", amp8.Recipe.preset("rowwise")),
    "O2-block": ("O2", amp8.Recipe.preset("deepseek")),
    "O3-delayed": ("O3", amp8.Recipe(scaling="delayed", amax_history_len=4)),
    "O2-mxfp8": ("O2", amp8.Recipe.preset("mxfp8")),
    "O3-mxfp8": ("O3", amp8.Recipe.preset("mxfp8")),
    "O1-nvfp4": ("O1", amp8.Recipe.preset("nvfp4")),
    "O3-nvfp4": ("O3", amp8.Recipe.preset("nvfp4")),
    "O2-outlier-split": ("O2", amp8.Recipe(granularity="rowwise", wgrad_outlier_split=True, wgrad_outlier_share=0.07)),
}
STEPS = 3
MICRO_BATCHES = 2  # the second micro-batch takes the cached FP8 weight


def _model(level: str, recipe: amp8.Recipe) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 32))
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, recipe=recipe)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, run: nn.Module,
           lengths: tuple[int, ...] = (8,), outlier_gain: float = 1.0) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` optimizer steps of ``MICRO_BATCHES`` micro-batches through ``run`` (the
    model or its compiled form), their sequence lengths taken from ``lengths`` in turn,
    each batch's first token ``outlier_gain`` times the others; what each micro-batch
    produced."""
    generator = torch.Generator().manual_seed(1)
    seen = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro_batch in range(MICRO_BATCHES):
            length = lengths[(step * MICRO_BATCHES + micro_batch) % len(lengths)]
            x = torch.randn(2, length, 32, generator=generator)
            x[:, 0] *= outlier_gain
            x.requires_grad_()
            y = run(x)
            y.square().mean().backward()
            grads = {f"{i}.weight_grad": m.weight_grad.dequantize() for i, m in enumerate(model) if isinstance(m, Fp8Linear)}
            seen.append({"y": y.detach(), "x.grad": x.grad, **grads})
        optimizer.step()
    return seen


def _stored(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _assert_bitwise_equal_runs(eager_model: nn.Module, model: nn.Module, expected: list[dict[str, torch.Tensor]],
                               actual: list[dict[str, torch.Tensor]]) -> None:
    """What each micro-batch gave, and the stored state after training, bit for bit."""
    for want, got in zip(expected, actual):
        for key in want:
            assert_bitwise_equal(got[key], want[key])
    stored = _stored(model)
    for key, value in _stored(eager_model).items():
        assert_bitwise_equal(stored[key], value)


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_capture_is_bitwise_eager(case: str) -> None:
    level, recipe = CASES[case]
    eager_model, eager_optimizer = _model(level, recipe)
    model, optimizer = _model(level, recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    expected, actual = _train(eager_model, eager_optimizer, eager_model), _train(model, optimizer, compiled)
    _assert_bitwise_equal_runs(eager_model, model, expected, actual)
    # One graph for the first micro-batch (casts the weight), one for the cached weight;
    # the steps after the first compile nothing new.
    cached_graphs = 2 if level != "O3" else 1
    assert counter.frame_count == cached_graphs, f"{counter.frame_count} graphs compiled"


Runs = list[dict[str, torch.Tensor]]
LENGTHS = (4, 6, 9)  # sequence lengths of successive micro-batches


def _train_dynamic(case: str) -> tuple[nn.Module, Runs]:
    """``case``'s model trained under ``torch.compile(model, dynamic=True)`` (captured by
    ``aot_eager``) on micro-batches of ``LENGTHS``: the model, and what each gave."""
    level, recipe = CASES[case]
    model, optimizer = _model(level, recipe)
    return model, _train(model, optimizer, torch.compile(model, dynamic=True, backend="aot_eager"), LENGTHS)


@pytest.mark.skipif(not _compat.DYNAMIC_SHAPE_LAYERS.available(),
                    reason=str(_compat.DYNAMIC_SHAPE_LAYERS.missing_reason()))
@pytest.mark.parametrize("case", ["O1-tensorwise", "O2-rowwise", "O2-block", "O3-delayed", "O3-nvfp4"])
def test_dynamic_shapes_capture_is_bitwise_eager(case: str) -> None:
    """``torch.compile(model, dynamic=True)`` over batches of changing sequence length:
    each recompile traces amp8's autograd Functions again, with symbolic sizes (and
    Dynamo turns the floats it reads from modules into graph inputs)."""
    level, recipe = CASES[case]
    eager_model, eager_optimizer = _model(level, recipe)
    expected = _train(eager_model, eager_optimizer, eager_model, LENGTHS)
    model, actual = _train_dynamic(case)
    _assert_bitwise_equal_runs(eager_model, model, expected, actual)


@pytest.mark.skipif(not _compat.DYNAMIC_SHAPE_LAYERS.available(),
                    reason=str(_compat.DYNAMIC_SHAPE_LAYERS.missing_reason()))
def test_dynamic_shapes_split_outlier_tokens_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight-gradient GEMM's outlier split (``wgrad_outlier_split``) under
    ``torch.compile(model, dynamic=True)``: its window of ``ceil(share * M)`` tokens comes
    from integers, so it traces with a symbolic M, and training takes out the same
    outlier tokens as eagerly, bit for bit (each batch's first token far above the rest)."""
    level, recipe = CASES["O2-outlier-split"]
    taken = []

    def split(x2: torch.Tensor, g2: torch.Tensor, share: tuple[int, int]):  # type: ignore[no-untyped-def]
        outliers, x_rest, g_rest = split_outlier_tokens(x2, g2, share)
        taken.append(int((x_rest == 0).all(1).sum()))
        return outliers, x_rest, g_rest

    eager_model, eager_optimizer = _model(level, recipe)
    with monkeypatch.context() as patch:
        patch.setattr(wgrad, "split_outlier_tokens", split)
        expected = _train(eager_model, eager_optimizer, eager_model, LENGTHS, outlier_gain=1e4)
    assert max(taken) >= 2, "the outlier tokens (one a sequence) are taken out"
    model, optimizer = _model(level, recipe)
    actual = _train(model, optimizer, torch.compile(model, dynamic=True, backend="aot_eager"), LENGTHS, outlier_gain=1e4)
    _assert_bitwise_equal_runs(eager_model, model, expected, actual)


def _eager_and_inductor(case: str) -> tuple[nn.Module, nn.Module, Runs, Runs]:
    """Two models of ``case`` from the same start, one trained eagerly and one compiled by
    Inductor: (eager model, compiled model, what each micro-batch gave eagerly, compiled)."""
    level, recipe = CASES[case]
    eager_model, eager_optimizer = _model(level, recipe)
    model, optimizer = _model(level, recipe)
    compiled = torch.compile(model, fullgraph=True)
    expected, actual = _train(eager_model, eager_optimizer, eager_model), _train(model, optimizer, compiled)
    return eager_model, model, expected, actual


@pytest.mark.parametrize("case", ["O1-tensorwise", "O2-rowwise"])
def test_inductor_matches_eager(case: str) -> None:
    eager_model, model, expected, actual = _eager_and_inductor(case)
    for want, got in zip(expected, actual):
        for key in want:
            assert_sqnr_at_least(want[key], got[key], 40.0)
    stored = _stored(model)
    for key, value in _stored(eager_model).items():
        if value.is_floating_point() and value.element_size() > 1:
            assert_sqnr_at_least(value.float(), stored[key].float(), 40.0)


def test_inductor_runs_the_emulated_rowwise_gemm_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU's ``torch._scaled_mm`` lacks rowwise scales, ``amp8.ops.gemm`` emulates
    it with an operator of its own, which Inductor runs as it is: compiled and eager
    training agree bit for bit (Inductor would otherwise lay the dequantized operand out
    column-major and sum the matmul in another order)."""
    monkeypatch.setattr(_compat, "native_rowwise_scaled_mm", lambda device: False)
    _, _, expected, actual = _eager_and_inductor("O2-rowwise")
    for want, got in zip(expected, actual):
        for key in want:
            assert_bitwise_equal(got[key], want[key])


def _compiled_data_parallel(
    rank: int, world: int, compile_model: bool, level: str, preset: str, trace_sharded: bool = False
) -> dict[str, torch.Tensor]:
    if trace_sharded:  # this process claims the feature, so a sharded layer is traced whatever the torch
        _compat.COMPILED_SHARDED_LAYERS = _compat.TorchFeature(_compat.COMPILED_SHARDED_LAYERS.name, (0, 0))
    model, optimizer = _model(level, amp8.Recipe.preset(preset))
    # FSDP2's hooks (O3) are not traced (torch._dynamo.disable): graphs break around
    # each layer there. O1/O2 compile whole.
    fullgraph = level != "O3"
    run = torch.compile(model, fullgraph=fullgraph, backend="aot_eager") if compile_model else model
    _train(model, optimizer, run)
    return multiprocess.full_state(model)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("level", "preset"), [("O2", "tensorwise"), ("O3", "tensorwise"), ("O2", "nvfp4")])
def test_compiled_data_parallel_matches_eager(tmp_path, level: str, preset: str) -> None:
    """Inside a compiled backward the weight-gradient hooks cannot run, so no bucket
    starts early; every bucket is reduced at ``step()``, with the same result. At O3 the
    FP8 weights are sharded by FSDP2, which gathers them around each compiled layer.
    NVFP4 adds the Hadamard rotation, stochastic rounding and 16 x 16 gradient tiles."""
    (tmp_path / "eager").mkdir()
    (tmp_path / "compiled").mkdir()
    eager = multiprocess.run(_compiled_data_parallel, tmp_path / "eager", False, level, preset)
    compiled = multiprocess.run(_compiled_data_parallel, tmp_path / "compiled", True, level, preset)
    for key, value in eager[0].items():
        for rank in range(2):
            assert_bitwise_equal(compiled[rank][key], value)


@pytest.mark.multiprocess
def test_sharded_layers_trace_where_the_table_says(tmp_path) -> None:
    """``amp8._compat.COMPILED_SHARDED_LAYERS`` against this torch: a compiled O3 model
    in data parallel whose sharded FP8 layers are traced (the fallback off) trains where
    the table has the feature and fails in Dynamo where it does not."""
    feature = _compat.COMPILED_SHARDED_LAYERS
    if feature.available():
        states = multiprocess.run(_compiled_data_parallel, tmp_path, True, "O3", "tensorwise", True)
        assert_bitwise_equal(states[1]["0.weight"], states[0]["0.weight"])
    else:
        with pytest.raises(Exception, match="overwrite_tensor_vt_proxy"):
            multiprocess.run(_compiled_data_parallel, tmp_path, True, "O3", "tensorwise", True)


def test_dynamic_shapes_trace_where_the_table_says() -> None:
    """``amp8._compat.DYNAMIC_SHAPE_LAYERS`` against this torch: with every size
    symbolic, a model trains where the table has the feature, and Dynamo fails an
    assert of its own where it does not."""
    if _compat.DYNAMIC_SHAPE_LAYERS.available():
        _train_dynamic("O1-tensorwise")
    else:
        with pytest.raises(AssertionError):
            _train_dynamic("O1-tensorwise")


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_inductor_fuses_the_amax_and_the_cast_into_one_kernel(scaling: str) -> None:
    """The cast to FP8 with its amax, scale and saturation is one generated kernel: no
    float32 intermediate goes through memory."""
    from torch._inductor.utils import run_and_get_code

    layer = Fp8Linear.from_linear(nn.Linear(256, 128), amp8.Recipe(scaling=scaling))

    def cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cast_x = layer.cast(amp8.nn.TensorRole.INPUT, x)
        return cast_x.data, cast_x.scale

    x = torch.randn(64, 256)
    (data, scale), sources = run_and_get_code(torch.compile(cast, fullgraph=True), x)
    kernels = [line for source in sources for line in source.splitlines() if "= async_compile." in line]
    assert len(kernels) == 1, f"{len(kernels)} kernels: {kernels}"
    assert data.dtype == torch.float8_e4m3fn
    assert_bitwise_equal(data, layer.cast(amp8.nn.TensorRole.INPUT, x, record=False).data)


class _Tied(nn.Module):
    """One FP8 layer called twice in a forward, then another."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_compiled_backward_gives_the_weight_its_gradient(level: str) -> None:
    """A compiled backward hands the FP8 weight gradient to the Parameter through
    autograd, as eager code does: a layer called twice gets the sum, tensor hooks and
    post-accumulate-grad hooks see it, ``torch.autograd.grad`` returns it; the same
    bits as eager."""
    torch.manual_seed(0)
    eager, _ = amp8.initialize(_Tied(), None, level)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    seen: list[type] = []
    accumulated: list[type] = []
    model.block.weight.register_hook(lambda grad: seen.append(type(grad)) or grad.clamp(-1e-2, 1e-2))
    model.block.weight.register_post_accumulate_grad_hook(lambda param: accumulated.append(type(param.grad)))
    eager.block.weight.register_hook(lambda grad: grad.clamp(-1e-2, 1e-2))
    compiled(x).square().mean().backward()
    eager(x).square().mean().backward()
    assert seen == [WeightGrad] and accumulated == [WeightGrad]
    for name in ("block", "head"):
        assert_bitwise_equal(getattr(model, name).weight_grad.data, getattr(eager, name).weight_grad.data)
        assert_bitwise_equal(getattr(model, name).weight_grad.scale, getattr(eager, name).weight_grad.scale)
    (grad,) = torch.autograd.grad(compiled(x).square().mean(), [model.head.weight])
    assert isinstance(grad, WeightGrad)
    assert_bitwise_equal(grad.dequantize(), eager.head.weight_grad.dequantize())
