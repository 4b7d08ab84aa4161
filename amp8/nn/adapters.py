"""Adapters (LoRA and the like, as Hugging Face PEFT builds them) beside FP8 base layers.

Found by structure, so nothing here imports PEFT: a PEFT tuner layer's class names its
adapter attributes in ``adapter_layer_names`` (``("lora_A", "lora_B", ...)``), and
holds the layer it adapts as ``base_layer``. The adapters stay in high precision (their
rank is rarely a multiple of 16, and they are a small share of the work); the base layer
may run in FP8. PEFT's own LoRA layer is rebuilt as ``amp8.nn.peft_lora.Fp8LoraLinear``
where its base is an ``Fp8Linear``, so that merging cannot write into amp8's storage.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from torch import nn

from amp8.nn.linear import Fp8Linear
from amp8.nn.lora_rules import lora_variant_reason


def adapter_modules(model: nn.Module) -> dict[int, str]:
    """``{id(module): why}`` for every module inside an adapter of a PEFT tuner layer
    (the modules under the names its class lists in ``adapter_layer_names``)."""
    found: dict[int, str] = {}
    for fqn, module in model.named_modules():
        names = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(names, tuple) or not isinstance(getattr(module, "base_layer", None), nn.Module):
            continue
        for name in names:
            adapter = getattr(module, name, None)
            if isinstance(adapter, nn.Module):
                why = f"adapter {name} of {type(module).__name__} {fqn!r}, kept in high precision"
                found.update((id(inner), why) for inner in adapter.modules())
    return found


def adapted_embeddings(model: nn.Module) -> dict[int, str]:
    """``{id(embedding): why}`` for every ``nn.Embedding`` a PEFT tuner layer adapts (its
    ``base_layer``): PEFT's embedding LoRA merges into the table's ``weight.data``, so amp8
    keeps the table as it is rather than store it scaled."""
    return {
        id(module.base_layer): f"base of {type(module).__name__} {fqn!r} (PEFT adapts and merges into it)"
        for fqn, module in model.named_modules()
        if isinstance(getattr(type(module), "adapter_layer_names", None), tuple)
        and type(getattr(module, "base_layer", None)) is nn.Embedding
    }


def check_lora_layers(model: nn.Module) -> None:
    """Refuse, before ``amp8.initialize`` changes anything, a PEFT LoRA layer with a
    variant (DoRA, ...) over an ``nn.Linear`` the swap would store scaled.

    Raises:
        ValueError: naming the layer, the variant and the fixes.
    """
    for fqn, module in model.named_modules():
        variants = getattr(module, "lora_variant", None)
        if isinstance(variants, dict) and variants and type(getattr(module, "base_layer", None)) is nn.Linear:
            names = sorted({type(variant).__name__ for variant in variants.values()})
            raise ValueError(
                f"{fqn!r}: {lora_variant_reason(names, True)}; use plain LoRA on an amp8 base (no use_dora or other "
                "variant), opt_level='O1-compute' (FP8 GEMMs, weights as they are), or keep the layer out of FP8 "
                "with module_filter"
            )


def lora_custom_modules() -> dict[type[nn.Module], type[nn.Module]]:
    """The mapping PEFT's ``LoraConfig._register_custom_module`` takes for amp8's layers
    (``{Fp8Linear: Fp8LoraLinear}``); see ``register_lora``.

    Raises:
        ImportError: PEFT is not installed.
    """
    from amp8.nn.peft_lora import Fp8LoraLinear

    return {Fp8Linear: Fp8LoraLinear}


def register_lora(config: Any) -> Any:
    """Let ``config`` (a ``peft.LoraConfig``) put LoRA adapters on ``Fp8Linear`` layers,
    for ``get_peft_model`` on a model ``amp8.initialize`` has already converted; returns
    ``config``. The registration lives on this config object only.

    Raises:
        TypeError: ``config`` is not a ``peft.LoraConfig``.
        ImportError: PEFT is not installed.
    """
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise TypeError(
            f"amp8.nn.register_lora takes a peft.LoraConfig, got {type(config).__name__}; "
            "build one with peft.LoraConfig(r=..., target_modules=[...])"
        )
    config._register_custom_module(lora_custom_modules())
    return config


def adopt_lora_layers(model: nn.Module) -> list[str]:
    """Rebuild each PEFT ``lora.Linear`` of ``model`` whose base layer is an ``Fp8Linear``
    as an ``Fp8LoraLinear`` (same adapters, same Parameters; see
    ``Fp8LoraLinear.from_lora_layer``); the names of those rebuilt. A model holds PEFT
    layers only where PEFT was imported, so nothing is imported here otherwise."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import Linear as LoraLinear

    from amp8.nn.peft_lora import Fp8LoraLinear

    return _rebuild(
        model,
        lambda module: type(module) is LoraLinear and isinstance(module.get_base_layer(), Fp8Linear),
        Fp8LoraLinear.from_lora_layer,
    )


def release_lora_layers(model: nn.Module) -> list[str]:
    """The reverse of ``adopt_lora_layers`` for a model whose bases are no longer amp8's
    (``amp8.export``): each ``Fp8LoraLinear`` becomes PEFT's own ``lora.Linear``."""
    if "peft" not in sys.modules:
        return []
    from amp8.nn.peft_lora import Fp8LoraLinear

    return _rebuild(model, lambda module: isinstance(module, Fp8LoraLinear), lambda module: module.to_lora_layer())


def _rebuild(model: nn.Module, matches: Callable[[nn.Module], bool], make: Callable[[Any], nn.Module]) -> list[str]:
    """Put ``make(module)`` in the place of every module of ``model`` that ``matches``;
    their names."""
    rebuilt = []
    for fqn, module in list(model.named_modules()):
        if fqn and matches(module):
            parent_name, _, child_name = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child_name, make(module))
            rebuilt.append(fqn)
    return rebuilt
