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
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), level)
    exported = amp8.export(model, optimizer, dtype=dtype)
    assert all(type(m) is not Fp8Linear for m in exported.modules())
    assert type(exported[0]) is nn.Linear and exported[0].weight.dtype == dtype
    assert isinstance(model[0], Fp8Linear), "export must leave the original alone"
    real = optimizer.read_weight(model[0].weight)
    torch.testing.assert_close(exported[0].weight.float(), real, atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 0)
    x = torch.randn(8, 32)
    assert_sqnr_at_least(exported(x.to(dtype)).float(), model(x), 18.0)
