"""amp8's casts run as compiled kernels in eager code (``amp8.nn.cast_kernels``): the same
bits as the eager operations, a few kernels per layer, no recompiles as shapes vary, and
eager operations where no compiler serves."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

import amp8
from amp8 import _compiled
from amp8.config.formats import FP8_DTYPES
from amp8.config.gemms import Signal
from amp8.nn import Fp8Linear
from amp8.nn.cast_kernels import CastSpec, run_cast
from amp8.nn.quantizer import CastRequest, LinearQuantizers, cast_operands
from amp8.nn.cast_rule import CastRule, TensorRole
from amp8.quant.health import GemmOperand, new_health
from amp8.tensor.weight_grad import GradLayout, WeightGrad
from tests.conftest import assert_bitwise_equal, load_bench
from moe_models import tiny_moe_model

pytestmark = pytest.mark.compile

RECIPES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe.preset("rowwise"),
    "block": amp8.Recipe(granularity="block", block_size=32),
    "delayed": amp8.Recipe(scaling="delayed", amax_history_len=4),
    "power-of-2": amp8.Recipe(power_of_2_scales=True, margin=1),
}


def _assert_same(a: tuple, b: tuple) -> None:
    """The same tensors, FP8 ones byte for byte (a NaN's sign bit aside, which no GEMM
    reads), in the same layout; of a health buffer, the noise power (a sum over the
    tensor, which a compiled graph adds in another order) to float32 rounding."""
    for left, right in zip(a, b):
        if left is None or right is None:
            assert left is None and right is None
            continue
        if left.shape == new_health().shape:
            torch.testing.assert_close(left[:, Signal.NOISE], right[:, Signal.NOISE], rtol=1e-5, atol=0)
            left, right = left[:, : Signal.NOISE], right[:, : Signal.NOISE]
        assert left.stride() == right.stride()
        if left.dtype in FP8_DTYPES:
            nan = left.float().isnan()
            assert torch.equal(nan, right.float().isnan())
            left, right = left.view(torch.uint8)[~nan], right.view(torch.uint8)[~nan]
        torch.testing.assert_close(left, right, rtol=0, atol=0, equal_nan=True)


def _spec(recipe: amp8.Recipe, role: TensorRole, **settings: object) -> CastSpec:
    return CastSpec(CastRule.for_role(recipe, role), role.value, **settings)  # type: ignore[arg-type]


LAYOUTS = {  # CastSpec settings: a forward input, an output gradient, a wgrad re-cast
    "rows": dict(record=True, update_history=True, watch=(GemmOperand.FPROP_INPUT,)),
    "rows+columns": dict(record=True, update_history=True, columns=True),
    "padded columns": dict(contract_dim=0, rows=False, columns=True, padded=True,
                           watch=(GemmOperand.WGRAD_INPUT,)),
}


# One cast serves both layouts only with one scale per tensor (CastSpec refuses others).
CASTS = [(recipe, layout) for recipe in RECIPES for layout in LAYOUTS
         if layout != "rows+columns" or recipe not in ("rowwise", "block")]


@pytest.mark.parametrize("rows", [48, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe, layout", CASTS)
def test_compiled_cast_is_the_eager_cast_bit_for_bit(recipe: str, layout: str, dtype: torch.dtype, rows: int) -> None:
    role = TensorRole.GRAD_OUTPUT if layout == "rows+columns" else TensorRole.INPUT
    spec = _spec(RECIPES[recipe], role, **LAYOUTS[layout])
    torch.manual_seed(rows)
    x = (torch.randn(rows, 96) * torch.logspace(-3, 3, 96)).to(dtype)
    # A NaN stays NaN, the power-of-2 recipe's scale unharmed; with scales per row or tile
    # the NaN stays in its own (a scale read at another row's index would spread it).
    x[0, 0] = float("nan") if recipe in ("power-of-2", "rowwise", "block") else x[0, 0]
    first = (torch.rand(3) + 0.5, torch.rand(3, RECIPES[recipe].history_len), new_health())
    buffers = [first, tuple(b.clone() for b in first)]
    results = [run_cast(spec, x, *buffers[i], compiled=compiled) for i, compiled in enumerate((False, True))]
    _assert_same(tuple(results[0]), tuple(results[1]))
    _assert_same(buffers[0], buffers[1])
    if spec.rows:  # the cast's own tensor, not a view of it: one tensor less to make and free
        assert all(result.rows._base is None for result in results)
    if spec.columns:
        columns = results[1].columns
        assert columns.t().is_contiguous()  # column-major
        assert columns.shape[0] == (-(-rows // 16) * 16 if spec.padded else rows)


def test_cast_spec_refuses_what_one_cast_cannot_give() -> None:
    rowwise = CastRule.for_role(RECIPES["rowwise"], TensorRole.INPUT)
    with pytest.raises(ValueError, match="one scale per tensor"):
        CastSpec(rowwise, 0, columns=True)
    with pytest.raises(ValueError, match="gives no data"):
        CastSpec(rowwise, 0, rows=False)
    with pytest.raises(ValueError, match="ask for columns too"):
        CastSpec(rowwise, 0, padded=True)
    with pytest.raises(ValueError, match="microscaled"):
        run_cast(CastSpec(CastRule.for_role(amp8.Recipe.preset("mxfp8"), TensorRole.INPUT), 0), torch.ones(32, 32),
                 None, None, None)


def _layers(recipe: amp8.Recipe, level: str, compiled: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48), nn.GELU(), nn.Linear(48, 32))
    model, _ = amp8.initialize(model, None, level, recipe, layer_selection="all")
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.set_compiled_casts(compiled)
    return model


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_layers_with_compiled_casts_train_as_eager_ones_bit_for_bit(recipe: str, level: str) -> None:
    runs = []
    for compiled in (False, True):
        model = _layers(RECIPES[recipe], level, compiled)
        grads = []
        for step, rows in enumerate((32, 24, 40)):
            torch.manual_seed(100 + step)
            x = torch.randn(rows, 64, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().pow(2).mean().backward()
            grads += [out.detach(), x.grad]
            for name, parameter in model.named_parameters():
                grad = parameter.grad
                grads.append(grad.dequantize() if hasattr(grad, "dequantize") else grad)
                parameter.grad = None
        runs.append((grads, [b.clone() for b in model.buffers()]))
    for left, right in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        torch.testing.assert_close(left, right, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_weight_casts_decode_the_stored_weight_as_eager_ones_do(level: str, transposed: bool) -> None:
    """A weight's casts decode its stored form inside the compiled cast (no float32 copy
    of the weight in between): over steps that write the weight, and so cast it again,
    compiled and eager casts give the same outputs, weights, optimizer state and buffers,
    bit for bit, for a Parameter holding ``W`` or (GPT-2's ``Conv1D``) ``W^T``."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = Conv1D(48, 64) if transposed else nn.Linear(64, 48)
        model, optimizer = amp8.initialize(
            nn.Sequential(layer), torch.optim.AdamW(layer.parameters(), lr=1e-2), level, RECIPES["rowwise"],
            layer_selection="all", compiled_casts=compiled,
        )
        seen = []
        for step in range(3):
            torch.manual_seed(100 + step)
            out = model(torch.randn(32, 64))
            out.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            state = [value for param_state in optimizer.state_dict()["state"].values()
                     for value in param_state.values() if isinstance(value, torch.Tensor)]
            seen += [out.detach(), *model.state_dict().values(), *state]
        runs.append(seen)
    assert len(runs[0]) == len(runs[1])
    for left, right in zip(*runs):
        torch.testing.assert_close(left, right, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("level", ["O1", "O3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_experts_with_compiled_casts_train_as_eager_ones_bit_for_bit(recipe: str, level: str) -> None:
    runs = []
    for compiled in (False, True):
        model, _ = amp8.initialize(tiny_moe_model(num_experts=4), None, level, RECIPES[recipe], layer_selection="all")
        assert amp8.nn.set_compiled_casts(model, compiled) == 3  # two Fp8Linear, one Fp8Experts
        grads = []
        for step, rows in enumerate((32, 20)):  # each expert's share of the tokens changes
            torch.manual_seed(100 + step)
            x = torch.randn(rows, 32, requires_grad=True)
            out = model(x)
            out.float().pow(2).mean().backward()
            grads += [out.detach(), x.grad]
            for parameter in model.parameters():
                grad = parameter.grad
                grads.append(grad.dequantize() if hasattr(grad, "dequantize") else grad)
                parameter.grad = None
        runs.append(grads)
        with _FP8Producers() as producers:
            model(torch.randn(16, 32)).sum().backward()
        assert bool(producers.fp8_writes) != compiled  # compiled, no eager operation converts to FP8
    for left, right in zip(*runs):
        torch.testing.assert_close(left, right, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("recipe, shape", [
    ("block", (64, 96)), ("block", (4, 32, 64)), ("block", (4, 64, 16)), ("rowwise", (4, 32, 64)),
    ("tensorwise", (4, 32, 64)), ("power-of-2", (64, 96)),
])
def test_weight_gradients_quantize_compiled_as_eagerly(recipe: str, shape: tuple[int, ...]) -> None:
    """The weight gradient's quantization compiles for each recipe's layout, of matrices
    and of stacks of experts (tiles spanning a dimension or not), without falling back to
    eager code, and stores the eager bits, with an inf whose NaN stays in its own tile."""
    layout = GradLayout.for_weight(RECIPES[recipe], shape)
    torch.manual_seed(0)
    value = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
    value[..., 3, 5] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = WeightGrad.from_float(value, layout, torch.float32, compiled=True)
    assert not [str(w.message) for w in caught if "could not compile" in str(w.message)]
    eager = WeightGrad.from_float(value, layout, torch.float32)
    for got, expected in zip(compiled.parts()[:2], eager.parts()[:2]):
        assert_bitwise_equal(got, expected)


def test_twenty_steps_of_three_layer_shapes_compile_nothing_after_the_first() -> None:
    model = _layers(amp8.Recipe(), "O2", compiled=True)
    graphs = []
    for rows in (32, 48, 24, 40, 17) * 4:  # batches aligned to 16 rows and not
        x = torch.randn(rows, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 19


class _FP8Producers(TorchDispatchMode):
    """Records the eager operations that convert to FP8: an FP8 output from tensor inputs
    none of which is FP8 (an allocation converts nothing; compiled graphs run inside as one call: an infra mode lets them run
    compiled); and every eager operation's new tensor (not a view of an input), as
    (operation, dtype, elements)."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.fp8_writes: list[str] = []
        self.outputs: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and not func.is_view:
            self.outputs.append((str(func), out.dtype, out.numel()))
        if isinstance(out, torch.Tensor) and out.dtype in FP8_DTYPES and inputs and not any(a.dtype in FP8_DTYPES for a in inputs):
            self.fp8_writes.append(str(func))
        return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_eager_layer_casts_only_in_compiled_kernels(recipe: str) -> None:
    layer = _layers(RECIPES[recipe], "O2", compiled=True)[0]
    x = torch.randn(32, 64, requires_grad=True)
    layer(x).sum().backward()  # compiles
    layer.zero_grad(set_to_none=True)
    with _FP8Producers() as producers:
        layer(x).sum().backward()
    assert producers.fp8_writes == []
    with _FP8Producers() as producers:  # the eager operations, for contrast
        layer.set_compiled_casts(False)
        layer(x).sum().backward()
    assert len(producers.fp8_writes) >= 3


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_weight_cast_makes_no_float32_copy_of_the_weight(level: str) -> None:
    """After a step writes the 16-bit stored weight, the forward's casts of it (for the
    forward and the input-gradient GEMM) decode it inside their compiled kernels: no
    eager operation makes a float32 tensor of the weight's size."""
    torch.manual_seed(0)
    model, optimizer = amp8.initialize(nn.Sequential(nn.Linear(64, 48)), None, level, RECIPES["rowwise"],
                                       layer_selection="all", compiled_casts=True)
    optimizer = amp8.optim.LowBitAdam(model.parameters(), lr=1e-2, level=level)
    x = torch.randn(32, 64)
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with _FP8Producers() as seen:
        model(x)
    weight_copies = [name for name, dtype, numel in seen.outputs if dtype == torch.float32 and numel == 64 * 48]
    assert weight_copies == []


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_the_input_gradient_gemm_takes_its_weight_cast_as_written(level: str) -> None:
    """Under rowwise scales the input-gradient GEMM has a weight cast of its own (scales
    per column), written column-major as the GEMM takes it: the backward copies no FP8
    weight (at O3 the cast is from the FP8 weight's values, at each forward)."""
    torch.manual_seed(0)
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(64, 48)), None, level, RECIPES["rowwise"],
                               layer_selection="all", compiled_casts=True)
    optimizer = amp8.optim.LowBitAdam(model.parameters(), lr=1e-2, level=level)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    y = model(x)
    with _FP8Producers() as seen:
        y.square().mean().backward()
    weight_copies = [name for name, dtype, numel in seen.outputs if dtype in FP8_DTYPES and numel == 64 * 48]
    assert weight_copies == []


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_eager_layer_runs_about_the_kernels_of_a_compiled_one(recipe: str) -> None:
    bench = load_bench("linear_kernels")
    shape = (64, 128, 256)
    eager = bench.count("O2", recipe, "eager", shape)
    compiled = bench.count("O2", recipe, "compiled", shape)
    eager_ops = bench.count("O2", recipe, "eager-ops", shape)
    least = bench.least(*shape, input_bytes=2)
    for phase in ("forward", "backward"):
        # Eager runs amp8's cast graphs and the GEMMs, and about the kernels of a compiled
        # layer: the reciprocals come from the casts, both layouts from one pass; one more
        # where a rowwise input gradient is converted to the float32 input's dtype, which
        # a compiled layer fuses.
        assert eager[phase]["kernels"] <= compiled[phase]["kernels"] + 1
        assert eager[phase]["kernels"] * 2 < eager_ops[phase]["kernels"]
        assert eager[phase]["bytes"] < eager_ops[phase]["bytes"] / 2
    # One call of compiled casts a pass: the forward's input; the backward's casts (the
    # output gradient's and, rowwise, wgrad's re-casts of it and of the input), then the
    # weight gradient into its slot; after a step, the weight's casts (rowwise, one for
    # each GEMM) and the input's.
    assert (eager["forward"]["graph_calls"], eager["backward"]["graph_calls"], eager["step's forward"]["graph_calls"]) == (1, 2, 2)
    # The forward: the input's cast (its amax, then one pass writing both layouts), the
    # GEMM, the bias's conversion; rowwise, the bias is added after the GEMM as well.
    assert eager["forward"]["kernels"] <= least["forward"]["kernels"] + (2 if recipe == "tensorwise" else 4)


def _backward_requests(quantizers: LinearQuantizers, g2: torch.Tensor, x2: torch.Tensor) -> tuple[CastRequest, ...]:
    """A rowwise backward's casts: the output gradient's for dgrad (recording its scale and
    amax), and wgrad's padded column-major re-casts of it and of the input."""
    wgrad = dict(contract_dim=0, rows=False, columns=True, padded=True)
    return (
        quantizers.grad_output.request(g2, record=True, update_history=True, watch=(GemmOperand.DGRAD_GRAD_OUTPUT,)),
        quantizers.grad_output.request(g2, watch=(GemmOperand.WGRAD_GRAD_OUTPUT,), **wgrad),
        quantizers.input.request(x2, watch=(GemmOperand.WGRAD_INPUT,), **wgrad),
    )


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_casts_made_together_are_the_casts_made_one_by_one(monkeypatch: pytest.MonkeyPatch, compiled: bool,
                                                           recipe: str) -> None:
    """``cast_operands`` makes a layer's casts in one call of compiled kernels: the same FP8
    data, scales and buffer writes as each cast made alone, in one compiled call instead
    of one each."""
    torch.manual_seed(0)
    g2 = torch.randn(37, 48) * torch.logspace(-2, 2, 48)
    x2 = torch.randn(37, 64).to(torch.bfloat16)
    calls = []
    compiled_for = _compiled.compiled_for

    def counted(function, spec, variant):  # type: ignore[no-untyped-def]
        calls.append(function.__name__)
        return compiled_for(function, spec, variant)

    monkeypatch.setattr(_compiled, "compiled_for", counted)
    runs = []
    for together in (True, False):
        quantizers = LinearQuantizers.build(RECIPES[recipe], torch.ones(3), torch.zeros(3, 4), new_health(),
                                            compiled=compiled)
        requests = _backward_requests(quantizers, g2, x2)
        casts = cast_operands(requests) if together else [cast_operands((request,))[0] for request in requests]
        tensors = [part for cast in casts for side in cast if side is not None
                   for part in (side.data, side.scale, side.inverse)]
        runs.append((*tensors, quantizers.input.scales, quantizers.input.histories, quantizers.input.health))
    _assert_same(runs[0], runs[1])
    expected = ["scaled_casts"] * 4 if compiled and _compiled.compiler_found("cpu") else []
    assert calls == expected  # together one call, alone three


def test_casts_of_different_layers_are_not_made_together() -> None:
    first, second = (LinearQuantizers.build(amp8.Recipe(), torch.ones(3), torch.zeros(3, 1)) for _ in range(2))
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match="one layer's operands"):
        cast_operands((first.input.request(x), second.input.request(x)))


def test_casts_run_eagerly_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "compiler_found", lambda device_type: False)
    spec = _spec(amp8.Recipe(), TensorRole.INPUT, record=False)
    before = counters["stats"]["unique_graphs"]
    out = run_cast(spec, torch.randn(16, 32), None, None, None, compiled=True)
    assert out.rows is not None and counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("compiled, tensor, expected", [
    (True, "plain", True),
    (False, "plain", False),  # the default
    (True, "parameter", False),  # a subclass (a DTensor, a Parameter) stays eager
    (True, "empty", False),  # nothing to gain
])
def test_which_casts_run_compiled(compiled: bool, tensor: str, expected: bool) -> None:
    x = torch.randn(0 if tensor == "empty" else 4, 16)
    x = nn.Parameter(x) if tensor == "parameter" else x
    assert _compiled.runs_compiled(x, compiled) is (expected and _compiled.compiler_found("cpu"))


class _BackendFailed(torch._dynamo.exc.BackendCompilerFailed):
    """Inductor's failure (its constructor's arguments differ between torch versions)."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)


@pytest.mark.parametrize("refusal", ["recompile limit", "backend failed"])
def test_a_cast_torch_cannot_compile_runs_eagerly_with_a_warning(monkeypatch: pytest.MonkeyPatch, refusal: str) -> None:
    def refuse(*args: object) -> object:
        if refusal == "backend failed":
            raise _BackendFailed("no triton")
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile limit reached")

    monkeypatch.setattr(_compiled, "compiled_for", lambda function, spec, variant: refuse)
    spec = _spec(amp8.Recipe(), TensorRole.INPUT)
    x = torch.randn(16, 32)
    with pytest.warns(RuntimeWarning, match="runs it eagerly"):
        out = run_cast(spec, x, None, None, None, compiled=True)
    assert torch.equal(out.rows.view(torch.uint8), run_cast(spec, x, None, None, None).rows.view(torch.uint8))


class _Watching(TorchDispatchMode):
    """A plain (not infra) dispatch mode, as a FLOP counter or a tracer is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_casts_run_eagerly_under_a_torch_dispatch_mode() -> None:
    spec = _spec(amp8.Recipe(), TensorRole.INPUT)
    x = torch.randn(16, 32)
    assert _compiled.runs_compiled(x, True) is _compiled.compiler_found("cpu")
    with _Watching():
        assert not _compiled.runs_compiled(x, True)
        out = run_cast(spec, x, None, None, None, compiled=True)  # torch.compile would refuse here
    assert torch.equal(out.rows.view(torch.uint8), run_cast(spec, x, None, None, None).rows.view(torch.uint8))


@pytest.mark.parametrize(("given", "expected"), [(None, False), (True, True), (False, False)])
def test_compiled_casts_default_to_the_models_device(given: bool | None, expected: bool) -> None:
    """``compiled_casts=None`` (the default) compiles the casts of a model on CUDA only
    (tests/test_cuda.py checks that side): on the CPU the layers keep eager casts."""
    model = nn.Sequential(nn.Linear(32, 32))
    model, _ = amp8.initialize(model, None, "O1", layer_selection="all", compiled_casts=given)
    assert model[0].compiled_casts is expected


def test_bad_compiled_casts_option() -> None:
    with pytest.raises(TypeError, match="compiled_casts='yes' is not valid"):
        amp8.initialize(nn.Sequential(nn.Linear(32, 32)), None, "O1", compiled_casts="yes")
