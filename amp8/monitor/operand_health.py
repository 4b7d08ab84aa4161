"""The health of each FP8 layer's GEMM operands, as the precision report shows it.

Every cast of a watched ``Fp8Linear`` writes its signals (amax, clipped and flushed
shares, error power) into the layer's ``health`` buffer (``amp8.quant.health``); a layer
is watched while ``amp8.Controller`` measures it, or inside ``watch_operands(model)``.
Nothing is computed here or while nobody watches: ``operand_health`` reads the buffer.
"""

from __future__ import annotations

import contextlib
from enum import Enum
from typing import Iterator

import torch
from torch import nn

from amp8.config.gemms import GemmOperand, Signal
from amp8.nn.cast_rule import TensorRole
from amp8.nn.linear import Fp8Linear
from amp8.quant.health import sqnr_db


class CastTensor(Enum):
    """A tensor of an FP8 layer whose casts the report and ``amp8.what_if`` show, by its
    label: a GEMM operand's label ends with the label of the tensor it is a cast of
    ("wgrad input": the input), and the FP8 weight gradient's cast is labelled alone."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad output"
    WEIGHT_GRADIENT = "weight gradient"

    @property
    def role(self) -> TensorRole | None:
        """Its role in the layer's GEMMs (None for the FP8 weight gradient, which no GEMM
        of the layer casts)."""
        return None if self is CastTensor.WEIGHT_GRADIENT else TensorRole[self.name]


GEMM_TENSORS = tuple(tensor for tensor in CastTensor if tensor.role is not None)
"""The tensors whose casts feed the layer's GEMMs: input, weight, output gradient."""


def operand_role(operand: GemmOperand) -> TensorRole:
    """The tensor an operand is a cast of (``WGRAD_INPUT``: the input)."""
    return TensorRole[operand.name.split("_", 1)[1]]


def casts_of(operands: dict[str, dict[str, float]] | None, tensor: CastTensor) -> list[dict[str, float]]:
    """The signals of the casts of ``tensor`` among a report row's ``operands``
    (``operand_health``), one per GEMM operand it feeds."""
    return [values for label, values in (operands or {}).items() if label.endswith(tensor.value)]


def _signals(row: torch.Tensor, scale: float | None = None) -> dict[str, float]:
    """A cast's health signals (``amp8.quant.health``), the error power as SQNR in dB,
    and the ``scale`` of its role where it has one."""
    values = {"amax": float(row[Signal.AMAX])} | ({} if scale is None else {"scale": scale})
    return values | {
        "saturated": float(row[Signal.SATURATED]),
        "underflow": float(row[Signal.UNDERFLOW]),
        "sqnr_db": sqnr_db(float(row[Signal.NOISE])),
    }


def operand_health(layer: Fp8Linear) -> dict[str, dict[str, float]] | None:
    """Per GEMM operand of ``layer`` that was cast while it was watched (its label, e.g.
    "fprop input"): the operand's amax, the scale its role last recorded, the shares of
    its values the cast clipped (``saturated``) and flushed to zero (``underflow``), and
    the cast's SQNR in dB; the largest (worst) of each since the buffer was cleared; and
    the same, but the scale, of the FP8 weight gradient's cast (labelled
    ``CastTensor.WEIGHT_GRADIENT``). None where no cast was watched."""
    health, scales = layer.health.detach().cpu(), layer.scale.detach().cpu()
    found = {
        operand.label: _signals(health[operand], float(scales[operand_role(operand)]))
        for operand in GemmOperand if bool((health[operand] != 0).any())
    }
    grad = layer.grad_health.detach().cpu()
    if bool((grad != 0).any()):  # the FP8 weight gradient's cast (O1-O3)
        found[CastTensor.WEIGHT_GRADIENT.value] = _signals(grad)
    return found or None


@contextlib.contextmanager
def watch_operands(model: nn.Module) -> Iterator[list[Fp8Linear]]:
    """Watch every FP8 layer's GEMM operands inside the block: their health buffers are
    cleared on entry and every cast writes its signals (a few elementwise passes per
    cast, none outside the block); on exit each layer watches as it did before (an
    ``amp8.Controller`` keeps its own schedule). The precision report then shows them
    (``amp8.report``: ``operands``). Yields the layers watched.

    Example::

        with amp8.watch_operands(model):
            loss = model(batch).loss
            loss.backward()
        amp8.report(model, optimizer).print()
    """
    layers = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    before = [layer.watch_health for layer in layers]
    for layer in layers:
        layer.health.zero_()
        layer.grad_health.zero_()
        layer.watch_health = True
    try:
        yield layers
    finally:
        for layer, watched in zip(layers, before):
            layer.watch_health = watched
