"""Which modules hold mixture-of-experts experts amp8 can run in FP8, found by structure.

transformers 5 keeps a MoE layer's experts in one module (``MixtralExperts``,
``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...) with two 3-D Parameters, ``gate_up_proj``
(E, 2I, H): each expert's gate and up projections, and ``down_proj`` (E, H, I), an
activation ``act_fn`` and ``forward(hidden_states, top_k_index, top_k_weights)``; the router
and its softmax live beside it, in the MoE block. amp8 recognises such a module by those
Parameters and that signature, whatever its class.

Other expert modules take part through a small protocol: a module (its class, or the
instance) with an ``amp8_experts_layout`` attribute holding an ``ExpertsLayout`` names its
two Parameters and its activation, and is then run as the default layout is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from amp8.quant.scale_layout import GEMM_ALIGNMENT

LAYOUT_ATTRIBUTE = "amp8_experts_layout"
"""The attribute through which an experts module declares its ``ExpertsLayout``."""
FORWARD_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")
"""The arguments an experts module's forward takes, in order."""
_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}
"""transformers' experts options (``use_experts_implementation``) and the value amp8 runs."""


@dataclass(frozen=True)
class ExpertsLayout:
    """Where amp8 finds an experts module's weights and activation.

    Attributes:
        gate_up: the name of the (E, 2I, H) Parameter: each expert's gate projection
            (its first I rows) and up projection (the next I), applied as ``x @ W^T``.
        down: the name of the (E, H, I) Parameter, applied as ``x @ W^T``.
        activation: the name of the module's activation, applied to the gate half:
            each expert computes ``down(activation(gate(x)) * up(x))``.
        gate_method: the name of a method mapping the gate-up output (tokens, 2I) to
            (tokens, I), used instead of the activation where the module has it
            (transformers' ``_apply_gate``).
    """

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    activation: str = "act_fn"
    gate_method: str = "_apply_gate"


DEFAULT_LAYOUT = ExpertsLayout()
"""The layout of transformers' experts modules."""


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of ``module`` if it holds experts: the one it declares (see
    ``LAYOUT_ATTRIBUTE``), else ``DEFAULT_LAYOUT`` where it has 3-D Parameters of those
    names; None for any other module.

    Raises:
        TypeError: ``module`` declares something other than an ``ExpertsLayout``.
    """
    declared = getattr(module, LAYOUT_ATTRIBUTE, None)
    if declared is not None:
        if not isinstance(declared, ExpertsLayout):
            raise TypeError(
                f"{type(module).__name__}.{LAYOUT_ATTRIBUTE} is a {type(declared).__name__}; set it to an "
                "amp8.nn.ExpertsLayout naming the module's Parameters and activation"
            )
        return declared
    params = dict(module.named_parameters(recurse=False))
    weights = [params.get(name) for name in (DEFAULT_LAYOUT.gate_up, DEFAULT_LAYOUT.down)]
    return DEFAULT_LAYOUT if all(w is not None and w.dim() == 3 for w in weights) else None


def experts_reason(module: nn.Module, layout: ExpertsLayout, shared: dict[int, list[str]]) -> str | None:
    """Why amp8 cannot run the experts ``module`` (of ``layout``) in FP8, or None if it can.

    It needs a (E, 2I, H) gate-up and a (E, H, I) down Parameter of its own (not shared,
    ``shared`` as ``amp8.nn.swap.shared_weight_names`` gives), H and I multiples of 16, no
    other Parameter or buffer (amp8's module would drop it), transformers' options at
    amp8's values (gated, no bias, not transposed, no norm after the experts), an
    activation or gate method, and ``forward(hidden_states, top_k_index, top_k_weights)``.
    """
    gate_up, down = getattr(module, layout.gate_up, None), getattr(module, layout.down, None)
    parameters = isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
    if not (parameters and gate_up.dim() == down.dim() == 3):
        return f"{layout.gate_up!r} and {layout.down!r} are not both 3-D Parameters of the module"
    experts, double, hidden = gate_up.shape
    reasons = []
    if double % 2 or tuple(down.shape) != (experts, hidden, double // 2):
        reasons.append(
            f"{layout.gate_up} {tuple(gate_up.shape)} and {layout.down} {tuple(down.shape)} are not "
            "(E, 2I, H) and (E, H, I)"
        )
    for name, size in (("hidden size H", hidden), ("intermediate size I", double // 2)):
        if size % GEMM_ALIGNMENT:
            reasons.append(f"{name}={size} is not a multiple of {GEMM_ALIGNMENT}")
    reasons += [f"{flag}={getattr(module, flag)!r}" for flag, value in _FLAGS.items()
                if getattr(module, flag, value) != value]
    others = [name for name in module.state_dict(keep_vars=True) if name not in (layout.gate_up, layout.down)]
    if others:
        reasons.append(f"it holds {', '.join(others)} besides {layout.gate_up} and {layout.down}")
    for name, param in ((layout.gate_up, gate_up), (layout.down, down)):
        if id(param) in shared:
            reasons.append(f"{name} is shared ({', '.join(shared[id(param)])})")
    gates = (getattr(module, layout.gate_method, None), getattr(module, layout.activation, None))
    if not any(callable(gate) for gate in gates):
        reasons.append(f"it has neither a {layout.gate_method}() method nor an activation {layout.activation!r}")
    arguments = tuple(inspect.signature(module.forward).parameters)[: len(FORWARD_ARGUMENTS)]
    if arguments != FORWARD_ARGUMENTS:
        reasons.append(f"its forward takes {arguments}, not {FORWARD_ARGUMENTS}")
    return "; ".join(reasons) or None


def expert_count(module: nn.Module) -> int | None:
    """E, the number of experts of an experts module; None for any other module."""
    layout = experts_layout(module)
    weight = None if layout is None else getattr(module, layout.gate_up, None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 3 else None


def routers(model: nn.Module) -> dict[int, str]:
    """The routers of the model's experts: ``{id(linear): why it is one}`` for every
    ``nn.Linear`` beside an experts module (a child of the same parent) whose
    out_features is that module's number of experts. Routing (its logits and softmax)
    stays in high precision."""
    found: dict[int, str] = {}
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        for name, child in children.items():
            count = expert_count(child)
            if count is None:
                continue
            where = f"{parent_name}.{name}" if parent_name else name
            for other in children.values():
                if isinstance(other, nn.Linear) and other.out_features == count:
                    found[id(other)] = f"router of the experts {where!r}: routing stays in high precision"
    return found
