"""What a LoRA layer may do over a base amp8 stores scaled: the one rule that the PEFT
layer (``amp8.nn.peft_lora``) and ``amp8.initialize`` (``amp8.nn.adapters``) both apply."""

from __future__ import annotations

from typing import Any

PLAIN_LORA_INITS = (True, False, "gaussian")
"""``LoraConfig.init_lora_weights`` values that draw the adapters alone; the others (PiSSA,
OLoRA, LoftQ, CorDA, EVA, ...) rewrite the base weight, which amp8 stores scaled."""


def lora_variant_reason(variants: list[str], init_lora_weights: Any) -> str | None:
    """Why a LoRA layer with these ``variants`` (DoRA and the like, by name) and this
    ``init_lora_weights`` cannot sit on a base whose weight amp8 stores scaled, or None."""
    if variants:
        return (
            f"the LoRA variant(s) {', '.join(variants)} read the base weight directly, which amp8 stores as "
            "FP16 or FP8 times a scale"
        )
    if init_lora_weights not in PLAIN_LORA_INITS:
        return f"init_lora_weights={init_lora_weights!r} rewrites the base weight, which amp8 stores scaled"
    return None
