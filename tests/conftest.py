"""Shared fixtures and numerics asserts for amp8's tests."""

from __future__ import annotations

import pytest
import torch

from amp8.scaling import sqnr


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    """Every test starts from the same random state."""
    torch.manual_seed(0)


def assert_sqnr_at_least(reference: torch.Tensor, approximation: torch.Tensor, floor_db: float) -> float:
    """Assert the SQNR of ``approximation`` against ``reference`` is >= ``floor_db``."""
    measured = sqnr(reference, approximation)
    assert measured >= floor_db, f"SQNR {measured:.2f} dB is below the {floor_db} dB floor"
    return measured


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert two tensors have the same dtype, shape and bits."""
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype.is_floating_point and actual.element_size() == 1:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


cuda_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 tensor cores (sm_89+); the CPU tests cover the same logic",
)
