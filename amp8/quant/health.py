"""Health signals of FP8 casts: how much of a tensor its cast loses.

Each ``Fp8Linear`` has six GEMM operands (``GemmOperand``: the input and weight of the
forward GEMM, the output gradient and weight of the input-gradient GEMM, the output
gradient and input of the weight-gradient GEMM). While a layer is measured, every cast
of an operand writes three numbers (``Signal``) into its row of the layer's ``health``
buffer, keeping the largest seen since the buffer was last cleared:

- the operand's absolute maximum (before scaling);
- the share of its values that the cast clips at the format's largest value;
- the share of its nonzero values that the cast flushes to zero;
- the power of the cast's error over the tensor's power (its SQNR is ``-10 log10`` of
  that: ``sqnr_db``).

They come from the tensor and its cast alone (elementwise passes while the layer is
watched, none otherwise), written in place so a compiled graph writes them too.
``amp8.Controller`` and the precision report read them.
"""

from __future__ import annotations

import math

import torch

from typing import TYPE_CHECKING

from amp8.config.formats import is_fp4, max_value
from amp8.config.gemms import Gemm, GemmOperand, Signal

if TYPE_CHECKING:  # a cast of that type is read, never built, here
    from amp8.tensor.block_scaled import BlockScaledTensor


SLOTS = len(GemmOperand)
SIGNALS = len(Signal)
_MAGNITUDE_BITS = 0x7F  # an FP8 byte without its sign bit: zero for +0.0 and -0.0


def new_health(device: torch.device | str | None = None) -> torch.Tensor:
    """An empty ``health`` buffer: (operands, signals) float32 zeros."""
    return torch.zeros(SLOTS, SIGNALS, device=device)


def clip_limit(dtype: torch.dtype) -> float:
    """The smallest scaled magnitude that ``dtype``'s cast clips: its max plus half the
    spacing of its top binade (below that, rounding to nearest gives the max anyway,
    as it does for the amax itself under current scaling)."""
    top = max_value(dtype)
    return top + torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top)) / 2


def cast_health(x: torch.Tensor, full_scale: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """The ``Signal`` values of one cast of ``x`` with ``full_scale`` (broadcastable
    against ``x``) to the FP8 ``data``: (amax, share of values clipped, share of nonzero
    values flushed to zero, error power over signal power), float32 (4,)."""
    with torch.no_grad():
        values = x.detach().float()
        magnitude = values.abs()
        if magnitude.numel() == 0:
            return torch.zeros(SIGNALS, device=x.device)
        clipped = magnitude * full_scale > clip_limit(data.dtype)
        flushed = (data.view(torch.uint8) & _MAGNITUDE_BITS) == 0
        return _signals(values, data.float() / full_scale, clipped, flushed)


def block_cast_health(x: torch.Tensor, cast: BlockScaledTensor) -> torch.Tensor:
    """``cast_health`` of a microscaled cast of ``x`` (as cast: after any rotation).

    Values beyond the element format's max plus half its top spacing (7 for E2M1) count
    as clipped. Flushed: under MXFP8, nonzero values that decode to zero; under NVFP4,
    nonzero values whose block scale flushed to zero (one tensor scale leaves E4M3 block
    scales about 17 binades). E2M1's grid spans under four binades, so NVFP4 flushes
    the small values of every block by design, 10-45 % of them in a healthy run
    (stochastic rounding keeps gradients unbiased there): that is not counted.
    """
    with torch.no_grad():
        magnitude = x.detach().float().abs()
        if magnitude.numel() == 0:
            return torch.zeros(SIGNALS, device=x.device)
        decode = cast.full_scales()
        fp4 = is_fp4(cast.dtype)
        element_limit = max_value(cast.dtype) + 1.0 if fp4 else clip_limit(cast.dtype)
        clipped = torch.where(decode > 0, magnitude / decode, 0.0) > element_limit
        dequantized = cast.dequantize()
        return _signals(x.detach().float(), dequantized, clipped, decode == 0 if fp4 else dequantized == 0)


def _signals(values: torch.Tensor, dequantized: torch.Tensor, clipped: torch.Tensor,
             decodes_to_zero: torch.Tensor) -> torch.Tensor:
    """(amax, share of values ``clipped``, share of nonzero values that decode to zero,
    error power over signal power) of ``values`` cast and read back as ``dequantized``."""
    magnitude = values.abs()
    nonzero = magnitude > 0
    flushed = (decodes_to_zero & nonzero).sum()
    power = values.square().sum()
    noise = torch.where(power > 0, (values - dequantized).square().sum() / power, 0.0)
    return torch.stack([
        magnitude.amax(),
        clipped.sum().float() / magnitude.numel(),
        flushed.float() / nonzero.sum().clamp(min=1).float(),
        noise,
    ])


def sqnr_db(noise: float) -> float:
    """The SQNR in dB of a cast whose ``Signal.NOISE`` is ``noise`` (inf for an exact
    cast, NaN for a NaN)."""
    return math.inf if noise == 0 else -10 * math.log10(noise)


def record_health(health: torch.Tensor, operands: tuple[GemmOperand, ...], signals: torch.Tensor) -> None:
    """Keep the largest of ``signals`` and what ``health`` holds, in the rows of
    ``operands``, in place."""
    with torch.no_grad():
        for operand in operands:
            row = int(operand)
            health[row] = torch.maximum(health[row], signals)
