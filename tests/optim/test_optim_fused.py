"""The compiled grouped optimizer step against the reference step, and the
counter-based stochastic rounding both use. Compiles run on the CPU through Inductor's
C++ backend; tensors are small and each test compiles one or two graphs."""

import copy

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.optim import LowBitAdam
from amp8.optim import state as state_storage
from amp8.optim import group_step
from amp8.optim.group_step import COMPILE_OPTIONS
from amp8.quant import noise, scaling
from amp8.quant.scaling import sqnr
from amp8.tensor import stored_weight
from conftest import assert_bitwise_equal, cuda_fp8, resume_from_checkpoint, train_steps

STEPS = 4


def _fp8_layers(model: nn.Module) -> dict[nn.Parameter, Fp8Linear]:
    return {module.weight: module for module in model.modules() if isinstance(module, Fp8Linear)}


def _twin_optimizers(
    level: str, recipe: amp8.Recipe = amp8.Recipe(), bias: bool = False, grouped: bool = True,
    device: str = "cpu", hidden: int = 48, **options
) -> tuple[list[nn.Module], list[LowBitAdam]]:
    """Two copies of one model (layers of two shapes, (``hidden``, 32) and (16, ``hidden``))
    on ``device`` with the reference optimizer (each tensor on its own, eager) and a
    compiled one (in update groups where ``grouped``); ``options`` go to
    ``torch.optim.AdamW`` or ``Adam``. Every layer runs in FP8 (on CUDA the default speed
    rule would keep layers this small in high precision)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, 16, bias=bias)).to(device)
    model, _ = amp8.initialize(model, None, level, recipe, layer_selection="all")
    models = [model, copy.deepcopy(model)]
    optimizer_class = torch.optim.Adam if options.pop("adam", False) else torch.optim.AdamW
    optimizers = [
        LowBitAdam.from_optimizer(
            optimizer_class(m.parameters(), **options), amp8.LEVELS[level], fused=fused, grouped=fused and grouped
        )
        for m, fused in zip(models, (False, True))
    ]
    return models, optimizers


def _step_both_with_the_same_gradients(models: list[nn.Module], optimizers: list[LowBitAdam]) -> None:
    reference, other = models
    for optimizer in optimizers:
        optimizer.zero_grad()
    reference(torch.randn(8, 32).to(next(reference.parameters()).device)).pow(2).mean().backward()
    for param, twin in zip(reference.parameters(), other.parameters()):
        if param.grad is not None:
            twin.grad = param.grad.clone()
    for layer, twin in zip(_fp8_layers(reference).values(), _fp8_layers(other).values()):
        twin.weight_grad = layer.weight_grad
    for optimizer in optimizers:
        optimizer.step()


def _assert_16_bit_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """FP16 or FP8 storage: same dtype, and the stored bits of at most 1 % of the elements
    one step apart (compiled float32 arithmetic may contract a multiply-add into an FMA,
    which moves a value across a rounding boundary now and then)."""
    assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
    integer = torch.int16 if actual.element_size() == 2 else torch.int8
    steps = (actual.view(integer).int() - expected.view(integer).int()).abs()
    assert int(steps.max()) <= 1, f"{name}: stored values {int(steps.max())} steps apart"
    share = float((steps > 0).float().mean())
    assert share <= 0.01, f"{name}: {100 * share:.2f} % of the elements differ by one step"


def _step_and_compare(models: list[nn.Module], optimizers: list[LowBitAdam], steps: int = STEPS) -> None:
    """``steps`` steps of both optimizers, each compared, then the fused twin set back to
    the reference's state: every step is measured from the same start (two trajectories
    one ulp apart would otherwise drift further apart by stochastic rounding alone)."""
    for _ in range(steps):
        _step_both_with_the_same_gradients(models, optimizers)
        _assert_fused_matches_reference(models, optimizers)
        with amp8.compact_state_dict(models[0]):
            models[1].load_state_dict(models[0].state_dict())
        optimizers[1].load_state_dict(optimizers[0].state_dict())


def _assert_fused_matches_reference(models: list[nn.Module], optimizers: list[LowBitAdam]) -> None:
    reference, fused = optimizers
    for param, twin in zip(models[0].parameters(), models[1].parameters()):
        name = f"{tuple(param.shape)}"
        handle, twin_handle = stored_weight(param), stored_weight(twin)
        if handle is None:
            # Plain parameters, float32: a multiply-add contracted to an FMA differs in the
            # last bit, which the weight's decay and update, cancelling, can make a large
            # share of a value near zero: bounded by the tensor's amax there (measured:
            # 1.5e-8 at most, 8.4e-8 x amax), a few ulps of the value elsewhere.
            amax = float(param.detach().abs().max())
            torch.testing.assert_close(twin.detach(), param.detach(), atol=2**-22 * amax, rtol=2**-21, msg=name)
        else:
            _assert_16_bit_within_one_ulp(twin_handle.data, handle.data, f"weight {name}")
        state, twin_state = reference.state[param], fused.state[twin]
        assert set(twin_state) == set(state), name
        for key in ("exp_avg", "exp_avg_sq"):
            expected, actual = (state_storage.load(s, key) for s in (state, twin_state))
            if state[key].dtype == torch.float32:
                # A lerp or multiply-add contracted to an FMA differs in the last bit, which
                # near a zero crossing is a large relative error: bound it by the tensor's
                # amax instead (measured: 1.2e-7 x amax at most, 146 dB).
                error = float((actual - expected).abs().max() / expected.abs().max())
                assert error <= 2**-20, f"{key} {name}: error {error:.2e} x amax"
                assert sqnr(expected, actual) >= 120, f"{key} {name}: SQNR {sqnr(expected, actual):.1f} dB"
            else:
                assert twin_state[key + "_layout"] == state[key + "_layout"], f"{key} {name}"
                measured = sqnr(expected, actual)
                assert measured >= 60, f"{key} {name}: SQNR {measured:.1f} dB against the reference step"
        if "master" in state:
            _assert_16_bit_within_one_ulp(twin_state["master"], state["master"], f"master {name}")
        assert_bitwise_equal(twin_state["step"], state["step"])
    assert fused.rounding_counter == reference.rounding_counter


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fused_step_matches_the_reference_step(level: str) -> None:
    """Four AdamW steps on layers of two shapes, one compiled graph for both (one update
    group), each step compared from the same state. Measured on this CPU: a few master or
    weight values per step one ulp apart (a multiply-add contracted to an FMA), O1's FP32
    moments within 1 ulp."""
    models, optimizers = _twin_optimizers(level, lr=1e-2, weight_decay=0.1)
    _step_and_compare(models, optimizers)
    assert len(optimizers[1].compiled_specs) == 1, "both shapes should share one graph"


@pytest.mark.compile
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fused_step_matches_the_reference_step_on_weights_kept_in_high_precision(level: str) -> None:
    """A hidden width of 24 keeps both layers in float32 (an FP8 GEMM takes multiples of
    16): their weights and biases step in update groups with the level's low-bit moments,
    compiled, and match the reference step (measured at O2 and O3 over four steps: at most
    41 of the first layer's 768 weights apart, by at most 1.5e-8, 8.0e-8 x its largest
    weight and up to 4e-5 of a weight near zero, where the decay and the update cancel)."""
    with pytest.warns(UserWarning, match="runs no layer in FP8"):
        models, optimizers = _twin_optimizers(level, lr=1e-2, weight_decay=0.1, hidden=24, bias=True)
    _step_both_with_the_same_gradients(models, optimizers)
    grouped = {member.param for group in optimizers[1].update_groups for member in group.members}
    plain = [param for param in models[1].parameters() if stored_weight(param) is None and param.dim() == 2]
    assert len(plain) == 2 and all(param in grouped for param in plain), "the float32 weights should step in groups"
    _assert_fused_matches_reference(models, optimizers)
    _step_and_compare(models, optimizers, steps=3)


@pytest.mark.compile
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_fused_step_matches_the_reference_step_at_any_row_width(granularity: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups whose rows are a multiple of 16 elements (at least 32) go to the compiled
    step in sixteens (``group_step.in_sixteens``; on a GPU, taken here on the CPU too), the
    others (the biases' rows of 16) as they are: both match the reference step."""
    taken = []
    monkeypatch.setattr(group_step, "takes_sixteens", lambda tensors: taken.append(tensors.grad.shape[1]) or True)
    models, optimizers = _twin_optimizers("O2", amp8.Recipe(granularity=granularity), lr=1e-2, weight_decay=0.1,
                                          hidden=80, bias=True)
    _step_both_with_the_same_gradients(models, optimizers)
    widths = [group.key.width for group in optimizers[1].update_groups]
    assert {width % 16 == 0 and width >= 32 for width in widths} == {True, False}, widths
    assert sorted(taken) == sorted(widths), (taken, widths)
    _assert_fused_matches_reference(models, optimizers)
    _step_and_compare(models, optimizers, steps=2)


@cuda_fp8
@pytest.mark.compile
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fused_step_on_cuda_matches_the_reference_step(level: str) -> None:
    """The same on a CUDA GPU, where the compiled update runs as Triton kernels (32-bit
    noise words whose products wrap, signed noise fields): a noise that differed from the
    reference step's would move about half the stochastically rounded values by a step."""
    models, optimizers = _twin_optimizers(level, lr=1e-2, weight_decay=0.1, device="cuda")
    _step_and_compare(models, optimizers)
    assert len(optimizers[1].compiled_specs) == 1, "both shapes should share one graph"


@pytest.mark.compile
@pytest.mark.parametrize(
    ("level", "granularity", "options"),
    [
        ("O3", "rowwise", dict(lr=1e-2, weight_decay=0.1)),
        ("O2", "block", dict(adam=True, lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1, maximize=True)),
    ],
)
def test_fused_step_with_fine_grained_scales(level: str, granularity: str, options: dict) -> None:
    """Rowwise and 16 x 16 block scales on gradients, the FP8 first moment and O3's FP8
    weights; the block case also runs Adam's L2 decay, maximize, and biases (FP32
    parameters with ``param.grad``). Measured: rowwise 1 of 768 master values 1 ulp
    apart, every low-bit moment > 100 dB."""
    recipe = amp8.Recipe(granularity=granularity, block_size=16)
    models, optimizers = _twin_optimizers(level, recipe, bias=granularity == "block", **options)
    _step_and_compare(models, optimizers)


def test_fused_defaults_to_cuda_only() -> None:
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(32, 16)), recipe=amp8.Recipe())
    optimizer = LowBitAdam(model.parameters())
    assert optimizer.fused is None
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    assert optimizer.update_groups and not optimizer.compiled_specs, "CPU parameters take the eager step by default"


@pytest.mark.parametrize("fused", ["yes", 1])
def test_bad_fused_option(fused: object) -> None:
    with pytest.raises(TypeError, match=f"fused={fused!r} is not valid"):
        LowBitAdam(nn.Linear(2, 2).parameters(), fused=fused)


def test_bad_seed() -> None:
    with pytest.raises(ValueError, match="seed=-1 is not valid"):
        LowBitAdam(nn.Linear(2, 2).parameters(), seed=-1)


# -- counter-based stochastic rounding ------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_bit_identical_eager_and_compiled(dtype: torch.dtype) -> None:
    """Values over 18 binades, subnormals and saturation included."""
    x = torch.randn(512, 64) * torch.logspace(-9, 9, 64, base=2.0) * 2.0**-12
    x[0, :4] = torch.tensor([0.0, -0.0, 1e9, -1e9])
    scale = torch.tensor(2.0**10)
    key = torch.tensor(noise.rounding_key(7, 3))

    def rounded(x: torch.Tensor, scale: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return scaling.quantize_stochastic(x, scale, dtype, key)

    compiled = torch.compile(rounded, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)
    assert_bitwise_equal(compiled(x, scale, key), rounded(x, scale, key))


def test_stochastic_rounding_brackets_and_is_unbiased() -> None:
    """1 + 0.1 ulp rounds up with probability 0.1: over 2**16 elements and 16 keys the
    share of rounding up is within 1 % of 0.1, and every result is one of the two FP16
    neighbours."""
    ulp = 2.0**-10
    x = torch.full((1 << 16,), 1.0 + 0.1 * ulp)
    draws = [
        scaling.quantize_stochastic(x, torch.ones(()), torch.float16, noise.rounding_key(0, counter)).float()
        for counter in range(16)
    ]
    for values in draws:
        assert bool(((values == 1.0) | (values == 1.0 + ulp)).all()), "results must bracket the input"
    share_up = float(torch.stack(draws).gt(1.0).float().mean())
    assert share_up == pytest.approx(0.1, rel=0.01)
    assert not torch.equal(draws[0], draws[1]), "each key should draw other noise"


def test_noise_is_uniform_and_keyed() -> None:
    draws = noise.uniform((1 << 16,), noise.rounding_key(0, 0), torch.device("cpu"))
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    assert float(draws.mean()) == pytest.approx(0.5, abs=0.005)
    histogram = torch.histc(draws, bins=16, min=0.0, max=1.0) / draws.numel()
    assert float((histogram - 1 / 16).abs().max()) < 0.005, histogram
    again = noise.uniform((1 << 16,), noise.rounding_key(0, 0), torch.device("cpu"))
    assert_bitwise_equal(again, draws)
    other_seed = noise.uniform((1 << 16,), noise.rounding_key(1, 0), torch.device("cpu"))
    assert float((other_seed == draws).float().mean()) < 0.001


def test_rounding_key_needs_non_negative_arguments() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        noise.rounding_key(0, -1)


def test_quantize_stochastic_rejects_a_generator() -> None:
    with pytest.raises(TypeError, match="counter-based: pass amp8.quant.noise.rounding_key"):
        scaling.quantize_stochastic(torch.ones(4), torch.ones(()), torch.float16, torch.Generator())


# -- checkpoints ----------------------------------------------------------------------
@pytest.mark.compile
def test_fused_checkpoint_resumes_bit_for_bit() -> None:
    batches = [torch.randn(8, 32) for _ in range(4)]

    def build() -> tuple[nn.Module, LowBitAdam]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=False))
        model, _ = amp8.initialize(model, None, "O2", recipe=amp8.Recipe())
        optimizer = LowBitAdam(model.parameters(), lr=1e-2, level=amp8.LEVELS["O2"], fused=True)
        return model, optimizer

    model, optimizer = build()
    uninterrupted = train_steps(model, optimizer, batches)
    final = [p.detach().clone() for p in model.parameters()]

    model, optimizer = build()
    first_half = train_steps(model, optimizer, batches[:2])
    resumed_model, resumed_optimizer = resume_from_checkpoint(build, model, optimizer)
    assert resumed_optimizer.rounding_counter == optimizer.rounding_counter == 2 * 2
    second_half = train_steps(resumed_model, resumed_optimizer, batches[2:])
    assert first_half + second_half == uninterrupted
    for param, expected in zip(resumed_model.parameters(), final):
        assert_bitwise_equal(param.detach(), expected)


def test_checkpoint_with_rounding_generators_loads_with_a_warning() -> None:
    """Checkpoints from before counter-based rounding hold torch.Generator states."""
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(32, 16)), recipe=amp8.Recipe())
    optimizer = LowBitAdam(model.parameters(), level=amp8.LEVELS["O2"], seed=5)
    state = optimizer.state_dict()
    del state["amp8"]["rounding"]
    state["amp8"]["generators"] = {"cpu": torch.Generator().manual_seed(5).get_state()}
    fresh = LowBitAdam(model.parameters(), level=amp8.LEVELS["O2"], seed=5)
    with pytest.warns(UserWarning, match="torch.Generator states for stochastic rounding"):
        fresh.load_state_dict(state)
    assert (fresh.seed, fresh.rounding_counter) == (5, 0)


def test_checkpoint_restores_seed_and_counter() -> None:
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(32, 16)), recipe=amp8.Recipe())
    optimizer = LowBitAdam(model.parameters(), level=amp8.LEVELS["O2"], seed=3)
    optimizer.rounding_counter = 41
    other = LowBitAdam(model.parameters(), level=amp8.LEVELS["O2"], seed=0)
    other.load_state_dict(optimizer.state_dict())
    assert (other.seed, other.rounding_counter) == (3, 41)


@pytest.mark.parametrize("elements_at_least", [True, False])
def test_default_fuses_large_optimizers_on_the_cpu(monkeypatch: pytest.MonkeyPatch, elements_at_least: bool) -> None:
    from amp8.optim import adam

    model = nn.Linear(32, 32)
    total = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(adam, "FUSED_CPU_MIN_ELEMENTS", total if elements_at_least else total + 1)
    optimizer = LowBitAdam(model.parameters(), level="O2")
    expected = elements_at_least and adam.cpp_compiler_found()
    explicit = LowBitAdam(model.parameters(), level="O2", fused=False)
    model(torch.randn(4, 32)).sum().backward()
    for stepped in (optimizer, explicit):
        stepped.step()
    assert bool(optimizer.compiled_specs) == expected
    assert explicit.update_groups and not explicit.compiled_specs
