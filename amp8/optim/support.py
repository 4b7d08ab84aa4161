"""What ``LowBitAdam`` accepts: the optimizers it takes over and the values it refuses."""

from __future__ import annotations

from typing import Any

import torch

from amp8.config.levels import OptLevel, Precision

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
# Options of torch's Adam that LowBitAdam has no use for (implementation choices).
TORCH_ONLY_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "amsgrad"})
_STATE_PRECISIONS = {"exp_avg": (Precision.FP32, Precision.FP8), "exp_avg_sq": (Precision.FP32, Precision.FP16)}


def check_state_precision(level: OptLevel) -> None:
    """Raise ``ValueError`` if ``level`` asks for Adam state storage amp8 does not have."""
    for key, allowed in _STATE_PRECISIONS.items():
        if getattr(level, key) not in allowed:
            raise ValueError(
                f"opt level {level.name} stores {key} as {getattr(level, key).value}; amp8 "
                f"stores it as one of {[p.value for p in allowed]}"
            )


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise if amp8 cannot take over ``optimizer`` (see ``LowBitAdam.from_optimizer``)."""
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{cls.__name__}" for cls in SUPPORTED_OPTIMIZERS)
        cls = type(optimizer)
        module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
        raise TypeError(
            f"amp8 cannot take over {module}.{cls.__qualname__}; "
            f"it supports {names}. Build one of those and pass it to amp8.initialize."
        )
    for index, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "differentiable"):
            if group.get(option, False):
                raise ValueError(
                    f"{option}=True (param group {index}) is not supported by amp8's low-bit "
                    f"Adam; build the optimizer with {option}=False"
                )
    if optimizer.state:
        raise ValueError(
            "the optimizer has already taken steps (it holds state); call amp8.initialize "
            "before the first optimizer.step()"
        )
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        raise ValueError(
            "a learning-rate scheduler is already attached to this optimizer; create the "
            "scheduler after amp8.initialize, on the optimizer that initialize returns"
        )


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Refuse what ``torch.optim.Adam`` refuses, with the allowed range."""
    problems = []
    if not lr >= 0:
        problems.append(f"lr={lr!r} (use lr >= 0)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        problems.append(f"betas={betas!r} (use two values in [0, 1))")
    if not eps >= 0:
        problems.append(f"eps={eps!r} (use eps >= 0)")
    if not weight_decay >= 0:
        problems.append(f"weight_decay={weight_decay!r} (use weight_decay >= 0)")
    if problems:
        raise ValueError(f"LowBitAdam: invalid {'; '.join(problems)}")


def check_options(seed: Any, fused: Any, state_block_size: Any) -> None:
    """Refuse a seed, ``fused`` flag or state block size ``LowBitAdam`` cannot use."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} is not valid; use an int >= 0")
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused={fused!r} is not valid; use True, False or None (fused on CUDA only)")
    if isinstance(state_block_size, bool) or not isinstance(state_block_size, int) or state_block_size < 0:
        raise ValueError(f"state_block_size={state_block_size!r} is not valid; use an int >= 0")


REMOVED_OPTIONS = {
    "fp8_layers": "LowBitAdam finds the FP8 weights among its parameters itself (amp8.initialize attaches "
    "an amp8.tensor.StoredWeight to each): pass model.parameters()",
    "data_parallel": "gradient averaging attaches itself to the optimizer (amp8.initialize does it); for a "
    "LowBitAdam built by hand, call amp8.distributed.GradientReduction.attach(optimizer, "
    "amp8.distributed.data_parallel_group(model))",
    "overlap_communication": "pass overlap where the averaging is attached: "
    "amp8.distributed.GradientReduction.attach(optimizer, data_parallel, overlap=False)",
    "reduction": "attach it after construction with optimizer.attach_gradient_average(reduction), or build "
    "and attach one with amp8.distributed.GradientReduction.attach(optimizer, data_parallel)",
}
REMOVED_ATTRIBUTES = {
    "read_weight": "use optimizer.master_weight(param) (the layer's read_weight() is unchanged)",
    "write_weight": "use optimizer.update_weight(param, value) (the layer's write_weight() is unchanged)",
    "reduction": "use optimizer.gradient_average (the attached amp8.distributed.GradientReduction)",
    "data_parallel": "use optimizer.gradient_average.data_parallel (the group of the attached "
    "amp8.distributed.GradientReduction), or amp8.distributed.data_parallel_group(model)",
}


def check_removed_options(options: dict[str, Any]) -> None:
    """Refuse keyword arguments ``LowBitAdam`` does not take: a removed one naming what
    replaces it, any other as Python would."""
    for name in options:
        if name in REMOVED_OPTIONS:
            raise TypeError(f"LowBitAdam({name}=...) was removed: {REMOVED_OPTIONS[name]}")
        raise TypeError(f"LowBitAdam got an unexpected keyword argument {name!r}")


def torch_groups(optimizer: torch.optim.Optimizer, replaced: dict[Any, Any]) -> list[dict[str, Any]]:
    """``optimizer``'s param groups as ``LowBitAdam`` takes them: each Parameter that
    ``replaced`` maps swapped for its replacement, torch-only options dropped, AdamW's
    decoupled decay made explicit."""
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    groups = []
    for group in optimizer.param_groups:
        copied = {key: value for key, value in group.items() if key not in TORCH_ONLY_KEYS}
        copied["params"] = [replaced.get(param, param) for param in group["params"]]
        copied.setdefault("decoupled_weight_decay", decoupled)
        groups.append(copied)
    return groups
