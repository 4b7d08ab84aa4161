import dataclasses
import warnings

import pytest
import torch
from torch import nn

import amp8
from amp8.config.levels import Precision
from amp8.nn import Fp8Linear
from amp8.optim import LowBitAdam
from conftest import mlp


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW])
def test_o1_swaps_layers_and_optimizer(optimizer_class) -> None:
    model = _model()
    params = list(model.parameters())
    optimizer = optimizer_class(
        [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "weight_decay": 0.1}],
        lr=1e-3, betas=(0.8, 0.9), eps=1e-6,
    )
    model, new_optimizer = amp8.initialize(model, optimizer, opt_level="O1", recipe=amp8.Recipe())
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear)
    assert isinstance(new_optimizer, LowBitAdam)
    assert [g["params"] for g in new_optimizer.param_groups] == [g["params"] for g in optimizer.param_groups]
    for new, old in zip(new_optimizer.param_groups, optimizer.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
            assert new[key] == old[key], key
        assert new["decoupled_weight_decay"] is (optimizer_class is torch.optim.AdamW)


def test_o0_changes_nothing() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out_model, out_optimizer = amp8.initialize(model, optimizer, opt_level="O0", recipe=amp8.Recipe())
    assert out_model is model and out_optimizer is optimizer
    assert all(type(m) is not Fp8Linear for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_model_without_optimizer() -> None:
    model, optimizer = amp8.initialize(_model(), recipe=amp8.Recipe())
    assert optimizer is None and isinstance(model[0], Fp8Linear)


def test_module_filter_is_passed_through() -> None:
    model, _ = amp8.initialize(_model(), module_filter=lambda module, fqn: fqn != "2", recipe=amp8.Recipe())
    assert isinstance(model[0], Fp8Linear) and type(model[2]) is nn.Linear


def test_recipe_reaches_the_layers() -> None:
    recipe = amp8.Recipe(scaling="delayed", amax_history_len=5)
    model, _ = amp8.initialize(_model(), recipe=recipe)
    assert model[0].recipe is recipe and model[0].amax_history.shape == (3, 5)


def test_unknown_opt_level() -> None:
    with pytest.raises(ValueError, match="'O0', 'O1', 'O2', 'O3'"):
        amp8.initialize(_model(), opt_level="O5", recipe=amp8.Recipe())


def test_other_optimizer_is_named_with_the_supported_ones() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"torch\.optim\.SGD.*torch\.optim\.Adam, torch\.optim\.AdamW"):
        amp8.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe=amp8.Recipe())


def test_amsgrad_is_rejected() -> None:
    model = _model()
    with pytest.raises(ValueError, match="amsgrad=True"):
        amp8.initialize(model, torch.optim.Adam(model.parameters(), amsgrad=True), recipe=amp8.Recipe())


def test_model_initialized_twice() -> None:
    model, _ = amp8.initialize(_model(), recipe=amp8.Recipe())
    with pytest.raises(ValueError, match="already initialized by amp8"):
        amp8.initialize(model, recipe=amp8.Recipe())


def test_optimizer_that_already_stepped() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="before the first optimizer.step"):
        amp8.initialize(model, optimizer, recipe=amp8.Recipe())


def test_scheduler_built_before_initialize() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(ValueError, match="create the scheduler after amp8.initialize"):
        amp8.initialize(model, optimizer, recipe=amp8.Recipe())


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_wrapped_model_is_rejected(level: str) -> None:
    with pytest.raises(TypeError, match="model is wrapped in DataParallel; call amp8.initialize on the bare model"):
        amp8.initialize(nn.DataParallel(_model()), opt_level=level, recipe=amp8.Recipe())
    inner = nn.Sequential(nn.DataParallel(_model()))
    with pytest.raises(TypeError, match=r"model\.0 is wrapped in DataParallel.*before any DDP or fully_shard"):
        amp8.initialize(inner, opt_level=level, recipe=amp8.Recipe())


def test_o0_leaves_a_wrapped_model_alone() -> None:
    wrapped = nn.DataParallel(_model())
    assert amp8.initialize(wrapped, opt_level="O0", recipe=amp8.Recipe())[0] is wrapped


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        amp8.initialize("model", recipe=amp8.Recipe())  # type: ignore[arg-type]


def test_bad_recipe_type() -> None:
    with pytest.raises(TypeError, match="amp8.Recipe"):
        amp8.initialize(_model(), recipe={"scaling": "delayed"})  # type: ignore[arg-type]


def test_device_without_fp8() -> None:
    model = _model().to("meta")
    with pytest.raises(RuntimeError, match="cannot run FP8 GEMMs"):
        amp8.initialize(model, recipe=amp8.Recipe())


@pytest.mark.parametrize(
    ("level", "weight_dtype", "has_master"),
    [("O1", torch.float16, False), ("O2", torch.float16, False), ("O3", torch.float8_e4m3fn, True)],
)
def test_weight_storage_follows_the_level(level: str, weight_dtype: torch.dtype, has_master: bool) -> None:
    model = _model()
    original = model[0].weight.detach().clone()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level, recipe=amp8.Recipe())
    assert model[0].weight_dtype == weight_dtype and model[0].weight.dtype == torch.float32
    state = optimizer.state.get(model[0].weight, {})
    assert ("master" in state) is has_master
    if has_master:  # taken from the weight before it dropped to FP8: FP16-accurate
        torch.testing.assert_close(optimizer.master_weight(model[0].weight), original, atol=0, rtol=2**-10)


def test_override_that_amp8_cannot_store() -> None:
    bad = dataclasses.replace(amp8.LEVELS["O2"], exp_avg=Precision.FP16)
    model = _model()
    with pytest.raises(ValueError, match="stores exp_avg as fp16"):
        amp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=bad, recipe=amp8.Recipe())


def test_scheduler_after_initialize_drives_the_new_optimizer() -> None:
    model = _model()
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1.0), recipe=amp8.Recipe())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    ("use", "error", "replacement"),
    [
        (lambda: amp8.distributed.DataParallel, ImportError, "DataParallelGroup"),
        (lambda: exec("from amp8.distributed import DataParallel"), ImportError, "DataParallelGroup"),
        (lambda: amp8.nn.Slot, ImportError, "TensorRole"),
        (lambda: exec("from amp8.nn import Slot"), ImportError, "TensorRole"),
        (lambda: amp8.ops.gemm.GemmRole, ImportError, r"amp8\.config\.Gemm"),
        (lambda: exec("from amp8.ops.gemm import GemmRole"), ImportError, r"amp8\.config\.Gemm"),
        (lambda: amp8.config.formats.support_reason, ImportError, r"E8M0 and FP4 are always torch dtypes"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters()).read_weight, AttributeError, "master_weight"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters()).write_weight, AttributeError, "update_weight"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters(), fp8_layers=[]), TypeError, "finds the FP8 weights"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters(), data_parallel=None), TypeError,
         r"GradientReduction\.attach\(optimizer, amp8\.distributed\.data_parallel_group\(model\)\)"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters(), overlap_communication=False), TypeError,
         r"GradientReduction\.attach\(optimizer, data_parallel, overlap=False\)"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters(), reduction=None), TypeError,
         r"optimizer\.attach_gradient_average\(reduction\)"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters()).reduction, AttributeError,
         r"optimizer\.gradient_average"),
        (lambda: amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters()).data_parallel, AttributeError,
         r"optimizer\.gradient_average\.data_parallel"),
        (lambda: amp8.tensor.is_sharded, ImportError, r"amp8\.tensor\.scaled"),
        (lambda: exec("from amp8.tensor import local_tensor"), ImportError, r"amp8\.tensor\.scaled"),
    ],
    ids=["DataParallel", "from-import DataParallel", "Slot", "from-import Slot", "GemmRole", "from-import GemmRole",
         "support_reason", "read_weight", "write_weight",
         "fp8_layers", "data_parallel=", "overlap_communication=", "reduction=", ".reduction", ".data_parallel",
         "is_sharded", "from-import local_tensor"],
)
def test_removed_names_name_their_replacement(use, error: type, replacement: str) -> None:
    with pytest.raises(error, match=f"was removed: .*{replacement}"):
        use()


def test_unknown_names_fail_as_python_says() -> None:
    assert not hasattr(amp8.distributed, "Nothing") and not hasattr(amp8.nn, "Nothing")
    assert not hasattr(amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters()), "nothing")
    with pytest.raises(TypeError, match="unexpected keyword argument 'betas2'"):
        amp8.optim.LowBitAdam(nn.Linear(2, 2).parameters(), betas2=0.9)


# -- old names ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("mark_weight_sharded", r"renamed mark_weights_sharded\(\)"),
        ("accumulate_weight_grad", r"weight\.grad"),
        ("register_weight_grad_hook", r"layer\.weight\.register_hook"),
        ("encode_weight", r"stored_weight\(layer\.weight\)\.encode"),
        ("store_weight", r"layer\.write_weight\(value\)"),
        ("weight_grad_nbytes", r"layer\.weight\.grad\.nbytes"),
    ],
)
def test_removed_layer_methods_name_their_replacement(name: str, replacement: str) -> None:
    """Fp8Linear's removed methods fail on a layer naming what does their job, and
    ``hasattr`` is False for them as for any missing name; Parameters and other missing
    names behave as in any module."""
    layer = amp8.nn.Fp8Linear.from_linear(nn.Linear(16, 16), amp8.Recipe())
    with pytest.raises(AttributeError, match=f"Fp8Linear.{name} was removed: .*{replacement}"):
        getattr(layer, name)
    assert not hasattr(layer, name)
    assert hasattr(layer, "mark_weights_sharded") and layer.weight.shape == (16, 16)
    with pytest.raises(AttributeError, match="'Fp8Linear' object has no attribute 'no_such_name'"):
        layer.no_such_name


def _amp8_warnings(model: nn.Module, level: str, **kwargs) -> list[str]:
    """The messages of the GEMM-share warnings ``initialize`` gives for ``model``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level, **kwargs)
    return [str(w.message) for w in caught if str(w.message).startswith("amp8: opt level")]


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O1-compute"])
def test_no_gemm_share_warning_on_an_ordinary_model(level: str) -> None:
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Linear(32, 64))
    assert _amp8_warnings(model, level) == []


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_warns_when_no_layer_runs_in_fp8(level: str) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    (message,) = _amp8_warnings(model, level, module_filter=lambda module, fqn: False)
    assert message.startswith(f"amp8: opt level {level} runs no layer in FP8: FP8 compute is absent")
    # Shares of the GEMM weights' elements: 32 x 64 and 64 x 10.
    assert "the largest: 0 (Linear, 76%): excluded by module_filter; 2 (Linear, 24%): out_features=10" in message


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_warns_when_most_gemm_work_stays_high(level: str) -> None:
    # The untied head (32 x 1024) holds 80% of the GEMM weights; the default recipe keeps it high.
    model = nn.Sequential(nn.Embedding(1024, 32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Linear(32, 1024))
    (message,) = _amp8_warnings(model, level)
    assert message.startswith(f"amp8: opt level {level} leaves about 80% of the GEMM FLOPs per token"), message
    assert "4 (Linear, 80%): output head" in message


def test_warns_when_the_model_has_no_gemm_layer() -> None:
    (message,) = _amp8_warnings(nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32)), "O2")
    assert message.startswith("amp8: opt level O2 found no GEMM layer to run in FP8")


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_an_optimizer_of_another_model_is_refused(level: str) -> None:
    model, other = mlp(32, 64, 32), mlp(32, 64, 32)
    with pytest.raises(ValueError, match="none of them is the model's.*model.parameters"):
        amp8.initialize(model, torch.optim.AdamW(other.parameters()), level)
    # An optimizer over some of the model's parameters and some of its own is the user's choice.
    extra = torch.nn.Parameter(torch.zeros(3))
    amp8.initialize(model, torch.optim.AdamW([*model[0].parameters(), extra]), level)
