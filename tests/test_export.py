import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from conftest import assert_sqnr_at_least


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_gives_plain_linear_layers(level: str, dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level, recipe=amp8.Recipe())
    exported = amp8.export(model, optimizer, dtype=dtype)
    assert all(type(m) is not Fp8Linear for m in exported.modules())
    assert type(exported[0]) is nn.Linear and exported[0].weight.dtype == dtype
    assert isinstance(model[0], Fp8Linear), "export must leave the original alone"
    real = optimizer.master_weight(model[0].weight)
    torch.testing.assert_close(exported[0].weight.float(), real, atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 0)
    x = torch.randn(8, 32)
    assert_sqnr_at_least(exported(x.to(dtype)).float(), model(x), 18.0)


@pytest.mark.parametrize("dtype", ["bf16", "float16", torch.float8_e4m3fn, torch.int8, None])
def test_export_refuses_what_is_not_a_float_dtype(dtype: object) -> None:
    model, _ = amp8.initialize(nn.Sequential(nn.Linear(32, 16)), None, "O1", recipe=amp8.Recipe())
    with pytest.raises(TypeError, match=r"use one of torch\.float32, torch\.bfloat16, torch\.float16"):
        amp8.export(model, dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(("model", "optimizer", "message"), [
    ("model", None, "amp8.export takes the model .* got str"),
    (nn.Linear(16, 16), "adam", "amp8.export takes the optimizer .* got str"),
])
def test_export_refuses_wrong_types(model: object, optimizer: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        amp8.export(model, optimizer)  # type: ignore[arg-type]


def _saved_by(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes by dtype autograd saves in a forward of ``model``."""
    with amp8.count_saved_bytes(model) as saved:
        model(x).sum()
    return saved.by_dtype


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_export_drops_amp8s_hooks(level: str) -> None:
    """The plain copy of a model trained with FP8 activations saves its activations as
    torch does, and a DDP built around it later ignores none of its parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model, _ = amp8.initialize(model, None, level, recipe=amp8.Recipe(activations="fp8"))
    model._ddp_params_and_buffers_to_ignore = ["user.name", "0.weight", "0.amax_history"]  # as initialize leaves them
    x = torch.randn(32, 64)
    assert "float8_e4m3fn" in _saved_by(model, x)
    plain = amp8.export(model)
    assert amp8.nn.activations.attached_storage(plain) is None
    assert not plain._forward_pre_hooks and not plain._forward_hooks
    assert set(_saved_by(plain, x)) == {"float32"}
    assert plain._ddp_params_and_buffers_to_ignore == ["user.name"]
    assert "float8_e4m3fn" in _saved_by(model, x), "the original keeps its storage"
