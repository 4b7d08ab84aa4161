"""``export``: a plain PyTorch copy of an amp8 model, for inference or other tools."""

from __future__ import annotations

import copy

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.validation import check_model_and_optimizer
from amp8.distributed.ddp import DDP, amp8_names, stop_watching
from amp8.nn.activations import detach_activation_storage
from amp8.nn.adapters import release_lora_layers
from amp8.nn.embedding import LowBitEmbedding
from amp8.nn.experts import Fp8Experts
from amp8.nn.linear import Fp8Linear
from amp8.tensor.scaled import is_sharded
from amp8.tensor.stored import StoredWeight

EXPORT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes ``export`` casts to: those an ``nn.Linear`` computes in."""


def export(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A deep copy of ``model`` with every ``Fp8Linear`` replaced by an ``nn.Linear``
    (and every ``LowBitEmbedding`` by an ``nn.Embedding``) holding the layer's real
    weight, every ``Fp8Experts`` by the model's own experts module it replaced (holding
    its real weights), cast to ``dtype``, and none of amp8's hooks (FP8 saved activations,
    the DDP guard): a plain PyTorch model. The original is not changed. PEFT's LoRA layers
    stay, as PEFT's own, over the plain bases: ``merge_and_unload()`` on the result merges.

    In a process group at O1/O2 every rank exports the whole weights it holds (the same
    on every rank), before or after ``amp8.distributed.register_ddp``; the copy holds no
    process group. Given the ``DistributedDataParallel`` around the model, it exports the
    model the DDP wraps (a DDP is not a model to hand on: wrap the result again if needed).

    Pass the optimizer at O3 to export the FP16 master weights instead of the FP8 ones
    (of the FP8 layers and the experts).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not an optimizer, or
            ``dtype`` not one of ``EXPORT_DTYPES`` (a string such as "bf16" included:
            pass ``torch.bfloat16``).
        ValueError: a weight sharded over data-parallel ranks.
    """
    check_model_and_optimizer("amp8.export", model, optimizer)
    if isinstance(model, DDP):
        model = model.module
    if not isinstance(dtype, torch.dtype) or dtype not in EXPORT_DTYPES:
        allowed = ", ".join(map(str, EXPORT_DTYPES))
        raise TypeError(f"amp8.export(dtype={dtype!r}) is not valid; use one of {allowed}")
    real_weights: dict[str, torch.Tensor] = {}
    expert_weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LowBitEmbedding):
            real_weights[name] = module.read_weight()
        elif isinstance(module, Fp8Linear):
            real_weights[name] = _real_weight(module.stored_weight, f"{name}.weight", optimizer)
        elif isinstance(module, Fp8Experts):
            expert_weights[name] = {
                handle.name: _real_weight(handle, f"{name}.{handle.name}", optimizer)
                for handle in module.stored_weights() if handle.storage is not Precision.AS_IS
            }
    exported = copy.deepcopy(model)
    for module in exported.modules():
        detach_activation_storage(module)
    stop_watching(exported, amp8_names(model))
    for name, real in real_weights.items():
        layer = exported.get_submodule(name)
        if isinstance(layer, LowBitEmbedding):
            plain: nn.Module = nn.Embedding(
                layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, device=real.device,
            )
        elif layer.weight_transposed:  # a Conv1D-like layer: the model's own module, weight (in, out)
            plain = layer.replaced_module(real)
        else:
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=real.device)
        with torch.no_grad():
            plain.weight.copy_(real)
            if getattr(layer, "bias", None) is not None:
                plain.bias.copy_(layer.bias)  # type: ignore[union-attr]
                plain.bias.requires_grad_(layer.bias.requires_grad)  # type: ignore[union-attr]
        plain.weight.requires_grad_(layer.weight.requires_grad)  # a frozen base stays frozen
        _replace(exported, name, plain)
        layer.weight_grad = None
    experts = [name for name, module in exported.named_modules() if isinstance(module, Fp8Experts)]
    for name in experts:
        _replace(exported, name, exported.get_submodule(name).to_module(expert_weights[name]))
    release_lora_layers(exported)  # PEFT's own LoRA layers again, over the plain bases
    return exported.to(dtype)


def _real_weight(handle: StoredWeight, name: str, optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
    """The whole real values of the stored weight ``name``: the optimizer's FP16 master
    where it keeps one (O3), else what the model stores.

    Raises:
        ValueError: the weight is sharded over data-parallel ranks.
    """
    if is_sharded(handle.param):
        raise ValueError(
            f"{name} is sharded over data-parallel ranks (O3 in a process group); export "
            "holds whole weights: export a model initialized in one process and loaded "
            "from the checkpoint (torch.distributed.checkpoint reshards it on load)"
        )
    if optimizer is not None and "master" in optimizer.state.get(handle.param, {}):
        return optimizer.master_weight(handle.param)  # type: ignore[attr-defined]
    return handle.read()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model``'s submodule ``name`` is."""
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, module)
