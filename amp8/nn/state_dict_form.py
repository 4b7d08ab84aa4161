"""The two forms of an amp8 model's ``state_dict``, and the switch between them.

- **Plain** (the default): what the model held before ``amp8.initialize``. Each FP8
  layer's weight is its real values (the stored values, dequantized) in the dtype the
  weight reports, and none of amp8's buffers (scales, amax histories, GEMM precision) is
  in it. It loads into the plain model class: ``load_state_dict`` (strict), Hugging Face
  ``from_pretrained``, safetensors. Loaded back into an amp8 model, each weight is
  stored again from those values (within one rounding of the stored ones), and amp8's
  buffers stay as the model has them.
- **Compact** (inside ``compact_state_dict(model)``): what amp8 holds. Each weight as
  stored (FP16 or FP8, one or two bytes per element) with its scales, and amp8's buffers;
  loaded into an amp8 model it restores the run bit for bit. It holds plain tensors too
  (safetensors takes FP8 dtypes), but a plain model cannot use them.

A layer whose weights FSDP2 shards (O3 in a process group) always gives the compact form:
each rank holds only its rows, as stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from amp8.nn.stored_module import StoredWeightsModule


@contextlib.contextmanager
def compact_state_dict(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model.state_dict()`` (and everything that calls it: ``torch.save``
    of it, a trainer's checkpoints) gives the compact form: the stored weights with their
    scales and amp8's buffers, which resume bit for bit. Outside, the plain form.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp8.compact_state_dict takes the model (an nn.Module), got {type(model).__name__}")
    layers = [module for module in model.modules() if isinstance(module, StoredWeightsModule)]
    before = [layer.__dict__.get("compact_state_dict") for layer in layers]
    for layer in layers:
        layer.compact_state_dict = True
    try:
        yield model
    finally:
        for layer, value in zip(layers, before):
            if value is None:
                layer.__dict__.pop("compact_state_dict", None)
            else:
                layer.compact_state_dict = value
