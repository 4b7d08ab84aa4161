"""Adam's step over many plain float32 tensors at once, with torch's fused Adam kernel.

A parameter that is not an FP8 layer's weight, at a level that keeps its moments in
float32 (O1's biases, norms and embeddings, or every parameter of a model whose layers
stay in high precision), stores nothing in low precision: its update is torch's Adam.
Taken one tensor at a time that costs a dozen kernel launches and a Python loop per
parameter, which on a GPU outlasts the arithmetic; here one call of the kernel behind
``torch.optim.Adam(fused=True)`` updates all of them, with the same results as that
optimizer, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp8.optim.state import MOMENTS


_PLAIN_STATE_KEYS = frozenset(("step", *MOMENTS))


def takes_plain_step(param: nn.Parameter, param_state: dict[str, Any]) -> bool:
    """Whether ``param``'s update is plain float32 Adam: a float32 parameter with a dense
    float32 gradient and float32 moments (no scales), and no master weight."""
    # Scales or a master weight beside the moments (the length first: comparing keys costs more).
    if len(param_state) != len(_PLAIN_STATE_KEYS) or param_state.keys() != _PLAIN_STATE_KEYS:
        return False
    grad = param.grad
    return (
        param.dtype is torch.float32
        and type(grad) is torch.Tensor  # not an FP8 weight's gradient
        and grad.dtype is torch.float32
        and not grad.is_sparse
        and param_state[MOMENTS[0]].dtype is torch.float32
        and param_state[MOMENTS[1]].dtype is torch.float32
    )


@torch.no_grad()
def plain_adam_step(
    params: list[nn.Parameter], states: list[dict[str, Any]], group: dict[str, Any], skip: torch.Tensor
) -> None:
    """One Adam step of ``params`` (all of one param group and device, each passing
    ``takes_plain_step``), their moments and steps in ``states``, updated in place,
    unless ``skip`` (a bool on the device: the kernel's ``found_inf``, as torch's
    ``GradScaler`` passes it). The step counts live on the parameters' device."""
    steps = [state["step"] for state in states]
    device = params[0].device
    found_inf = skip.to(device, torch.float32)
    torch._foreach_add_(steps, 1.0)
    (beta1, beta2) = group["betas"]
    kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    kernel(
        params, [param.grad for param in params], [state[MOMENTS[0]] for state in states],
        [state[MOMENTS[1]] for state in states], [], steps,
        lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
        amsgrad=False, maximize=group["maximize"], grad_scale=None, found_inf=found_inf,
    )
    torch._foreach_sub_(steps, [found_inf] * len(steps))
