"""What amp8's benchmarks share in setting up a case: an empty device, a fresh compiler,
and torchao's float8 training where it imports."""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from records import error_text


def free_memory(device: torch.device) -> None:
    """Return the memory of dropped models to the device and restart its peak count, so
    each case starts from the same empty device and reports its own peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def torchao_float8() -> tuple[Callable[..., Any] | None, str]:
    """``(convert, "available: torchao <version>")`` where torchao's float8 training
    imports, ``convert(module, recipe="tensorwise", module_filter_fn=None)`` being its
    ``convert_to_float8_training`` with the named recipe ("tensorwise" or "rowwise");
    else ``(None, "unavailable: <reason>")``."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        Float8LinearConfig.from_recipe_name("tensorwise")
    except Exception as error:  # ImportError, or a torchao built for another torch
        return None, f"unavailable: {error_text(error)}"

    def convert(module: Any, recipe: str = "tensorwise", module_filter_fn: Any = None) -> Any:
        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(module, config=config, module_filter_fn=module_filter_fn)

    return convert, f"available: torchao {getattr(torchao, '__version__', '?')}"


def graph_break_count() -> int:
    """Graph breaks torch.compile has recorded in this process since the last reset."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def reset_compiler() -> None:
    """Forget compiled code and graph-break counts, so each case compiles afresh and
    never falls back to eager on dynamo's recompilation limit."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
