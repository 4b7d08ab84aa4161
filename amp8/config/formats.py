"""FP8 (and Blackwell's FP4 and E8M0) formats and the format choices a recipe can make.

E4M3 (``torch.float8_e4m3fn``, max 448) has more precision, E5M2 (``torch.float8_e5m2``,
max 57344) more range. HYBRID uses E4M3 for activations and weights and E5M2 for
gradients; E4M3 uses E4M3 for every tensor.
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from amp8.config.validation import removed_name

E4M3: torch.dtype = torch.float8_e4m3fn
E5M2: torch.dtype = torch.float8_e5m2
FP8_DTYPES: tuple[torch.dtype, ...] = (E4M3, E5M2)
E8M0: torch.dtype = torch.float8_e8m0fnu
"""The MX block-scale dtype (an 8-bit power of two)."""
FP4: torch.dtype = torch.float4_e2m1fn_x2
"""Two E2M1 values packed in a byte."""


class Fp8Format(str, Enum):
    """Which FP8 dtype each tensor role gets."""

    HYBRID = "HYBRID"
    E4M3 = "E4M3"


def forward_dtype(fmt: Fp8Format) -> torch.dtype:
    """The FP8 dtype of activations and weights under ``fmt`` (E4M3 for both formats)."""
    return E4M3


def gradient_dtype(fmt: Fp8Format) -> torch.dtype:
    """The FP8 dtype of gradients under ``fmt``: E5M2 for HYBRID, E4M3 for E4M3."""
    return E5M2 if fmt is Fp8Format.HYBRID else E4M3


def max_margin(fmt: Fp8Format) -> int:
    """The largest ``Recipe.margin`` for ``fmt``: with it, a tensor's amax still lands on
    a normal number of every dtype ``fmt`` uses (14 for both formats, set by E4M3's
    range); beyond it the amax falls among the subnormals and the rest of the tensor
    to zero."""
    dtypes = {forward_dtype(fmt), gradient_dtype(fmt)}
    return min(math.floor(math.log2(max_value(dtype) / torch.finfo(dtype).tiny)) for dtype in dtypes)


def max_value(dtype: torch.dtype) -> float:
    """The largest finite value of a floating dtype, read from ``torch.finfo`` (6 for
    FP4, which has none)."""
    # A literal, not FP4_MAX: under torch.compile(dynamic=True) Dynamo lifts a module's
    # float into a graph input when it recompiles, which fails inside an autograd.Function.
    return 6.0 if is_fp4(dtype) else float(torch.finfo(dtype).max)


def short_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``; None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def is_fp4(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` is the packed FP4 dtype."""
    return dtype == FP4


FP4_MAX: float = max_value(FP4)
"""The largest E2M1 value (torch has no ``finfo`` for a packed dtype); code that
``torch.compile`` may trace reads it through ``max_value(FP4)`` (see there)."""


_REMOVED = {
    "support_reason": "every torch amp8 supports has the microscaling dtypes (E8M0 and FP4 are always torch "
    "dtypes); amp8._compat says what a torch release lacks",
}


def __getattr__(name: str) -> object:
    """Removed names fail naming what replaces them."""
    raise removed_name("amp8.config.formats", name, _REMOVED, module=True)
