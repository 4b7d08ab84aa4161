"""``Fp8LoraLinear``: PEFT's LoRA layer over an ``Fp8Linear`` base.

Imports PEFT; ``amp8.nn.adapters`` loads it only where PEFT is in use. The adapters
(``lora_A``, ``lora_B``) are PEFT's own high-precision ``nn.Linear`` layers; only the
base runs in FP8. What differs from PEFT's ``lora.Linear``: the base's widths are read
from the layer (PEFT recognizes ``nn.Linear`` and a few named classes), and merging into
a base amp8 stores is refused, since PEFT adds the adapter's delta to
``base_layer.weight.data``, which holds ``w * weight_scale`` in FP16 or FP8 here.
"""

from __future__ import annotations

from typing import Any

from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from amp8.config.levels import Precision
from amp8.nn.lora_rules import lora_variant_reason
from amp8.nn.single_weight import SingleStoredWeightModule


class Fp8LoraLinear(LoraLinear):
    """A PEFT LoRA layer whose base layer is an ``amp8.nn.Fp8Linear``.

    Built by PEFT (``get_peft_model`` with a config passed through
    ``amp8.nn.register_lora``) or by ``amp8.initialize`` from PEFT's ``lora.Linear``
    (``from_lora_layer``). Forward, adapters, saving and loading adapters, ``unload`` and
    ``disable_adapter`` are PEFT's. ``merge`` (and so ``merge_and_unload``) works once
    ``amp8.export`` has given the base back as an ``nn.Linear``.
    """

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        return base.in_features, base.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs: Any) -> None:
        """PEFT's, after refusing what would read or rewrite a base amp8 stores scaled.

        Raises:
            ValueError: a LoRA variant (DoRA, ...) or an ``init_lora_weights`` that
                rewrites the base (PiSSA, OLoRA, ...) on a base stored in FP16 or FP8.
        """
        base = self.get_base_layer()
        if isinstance(base, SingleStoredWeightModule) and base.weight_storage is not Precision.AS_IS:
            variant = self.resolve_lora_variant(config=config)
            names = [] if variant is None else [type(variant).__name__]
            reason = lora_variant_reason(names, config.init_lora_weights)
            if reason is not None:
                raise ValueError(
                    f"{reason}; use plain LoRA (init_lora_weights=True or 'gaussian', no use_dora or other variant) "
                    "on an amp8 base, or apply this LoRA before amp8.initialize at opt_level='O1-compute'"
                )
        super().update_layer(adapter_name, r, lora_alpha, config=config, **kwargs)

    @classmethod
    def from_lora_layer(cls, layer: LoraLinear) -> "Fp8LoraLinear":
        """``layer`` (PEFT's ``lora.Linear`` over an ``Fp8Linear``) as an
        ``Fp8LoraLinear``: the same adapters, Parameters, settings and hooks (its state
        shallowly copied; ``layer`` itself is left as it is)."""
        return _rebuilt_as(cls, layer)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Merge the adapters into a high-precision base (PEFT's merge).

        Raises:
            ValueError: the base layer is amp8's and stores its weight scaled, in FP16 or
                FP8 (O1-O3), where an added delta would corrupt it; the message names the
                fix. At "O1-compute" the weight is as the model had it, and merging works.
        """
        base = self.get_base_layer()
        if isinstance(base, SingleStoredWeightModule) and base.weight_storage is not Precision.AS_IS:
            raise ValueError(
                f"cannot merge LoRA adapters into an amp8 {type(base).__name__}: its weight is stored "
                f"as {base.weight_dtype} times a scale, and PEFT adds the adapter's delta to it unscaled. "
                "Export first, then merge: merged = amp8.export(model).merge_and_unload() "
                "(amp8.export gives the base layers back as nn.Linear in float32)"
            )
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def to_lora_layer(self) -> LoraLinear:
        """This layer as PEFT's own ``lora.Linear`` (for a base that is no longer
        amp8's: what ``amp8.export`` returns)."""
        return _rebuilt_as(LoraLinear, self)


def _rebuilt_as(cls: type[LoraLinear], layer: LoraLinear) -> Any:
    """A new ``cls`` holding ``layer``'s state: the same adapters, Parameters, settings and
    hooks, in registries of its own (so that replacing its base leaves ``layer``'s)."""
    rebuilt = cls.__new__(cls)
    state: dict[str, Any] = dict(layer.__dict__)
    for registry in ("_parameters", "_buffers", "_modules"):
        state[registry] = dict(state[registry])
    rebuilt.__dict__.update(state)
    return rebuilt
