"""Switch a model's FP8 casts between eager operations and amp8's compiled kernels."""

from __future__ import annotations

from torch import nn

from amp8.nn.experts import Fp8Experts
from amp8.nn.linear import Fp8Linear


def set_compiled_casts(model: nn.Module, compiled: bool) -> int:
    """``set_compiled_casts(compiled)`` on every ``Fp8Linear`` and ``Fp8Experts`` in
    ``model``: their casts outside ``torch.compile`` run as amp8's compiled kernels (True)
    or as eager operations (False, the default), with the same bits (see
    ``amp8.nn.cast_kernels``). Returns the layers set."""
    layers = [module for module in model.modules() if isinstance(module, (Fp8Linear, Fp8Experts))]
    for layer in layers:
        layer.set_compiled_casts(compiled)
    return len(layers)
