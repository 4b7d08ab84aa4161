import pytest
import torch

from amp8.config.formats import E4M3, E5M2
from amp8.tensor.scaled import ScaledTensor
from conftest import assert_sqnr_at_least


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.float16])
def test_from_float_and_back(dtype: torch.dtype) -> None:
    x = torch.randn(32, 64) * 1e-3
    stored = ScaledTensor.from_float(x, dtype)
    assert stored.dtype == dtype
    assert stored.shape == x.shape
    assert stored.data.abs().float().max() == torch.finfo(dtype).max
    assert_sqnr_at_least(x, stored.dequantize(), 25.0)


def test_nbytes_counts_data_and_scale() -> None:
    stored = ScaledTensor.from_float(torch.randn(10, 16), E4M3)
    assert stored.nbytes == 160 + 4


def test_power_of_2_scale() -> None:
    stored = ScaledTensor.from_float(torch.randn(100), E4M3, power_of_2=True)
    mantissa, _ = torch.frexp(stored.scale)
    assert float(mantissa) == 0.5
