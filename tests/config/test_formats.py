import pytest
import torch

from amp8.config.formats import E4M3, E5M2, Fp8Format, forward_dtype, gradient_dtype, max_value, short_name


@pytest.mark.parametrize(("dtype", "largest"), [(E4M3, 448.0), (E5M2, 57344.0), (torch.float16, 65504.0)])
def test_max_value_is_the_formats_largest_finite_value(dtype: torch.dtype, largest: float) -> None:
    assert max_value(dtype) == largest


@pytest.mark.parametrize(
    ("fmt", "forward", "gradient"),
    [(Fp8Format.HYBRID, E4M3, E5M2), (Fp8Format.E4M3, E4M3, E4M3)],
)
def test_format_roles(fmt: Fp8Format, forward: torch.dtype, gradient: torch.dtype) -> None:
    assert forward_dtype(fmt) == forward
    assert gradient_dtype(fmt) == gradient


def test_short_name() -> None:
    assert short_name(E4M3) == "float8_e4m3fn"
    assert short_name(None) is None
