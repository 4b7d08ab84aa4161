"""Adam's reference step over many plain float32 tensors at once, with torch's
multi-tensor (``torch._foreach_*``) operations.

A parameter that is not an FP8 layer's weight, at a level that keeps its moments in
float32 (O1's biases, norms and embeddings, or every parameter of a model whose layers
stay in high precision), stores nothing in low precision: its update is torch's Adam.
Taken one tensor at a time that costs a dozen kernel launches and a Python loop per
parameter, which on a GPU outlasts the arithmetic; here each operation runs once over
all of them. The operations and their order are those of ``LowBitAdam``'s reference
step, so the results are the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp8.optim.state import MOMENTS


def takes_foreach_step(param: nn.Parameter, param_state: dict[str, Any]) -> bool:
    """Whether ``param``'s update is plain float32 Adam: a float32 parameter with a dense
    float32 gradient and float32 moments (no scales), and no master weight."""
    grad = param.grad
    return (
        param.dtype == torch.float32
        and type(grad) is torch.Tensor  # not an FP8 weight's gradient
        and grad.dtype == torch.float32
        and not grad.is_sparse
        and set(param_state) == {"step", *MOMENTS}  # no scales, no master weight
        and all(param_state[key].dtype == torch.float32 for key in MOMENTS)
    )


@torch.no_grad()
def foreach_adam_step(params: list[nn.Parameter], states: list[dict[str, Any]], group: dict[str, Any]) -> None:
    """One Adam step of ``params`` (all of one param group and device, each passing
    ``takes_foreach_step``), their moments and steps in ``states``, updated in place."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    weight_decay = group["weight_decay"]
    weights = [param.detach() for param in params]
    grads = [param.grad for param in params]
    exp_avgs = [state[MOMENTS[0]] for state in states]
    exp_avg_sqs = [state[MOMENTS[1]] for state in states]
    steps = []
    for state in states:
        state["step"] += 1
        steps.append(float(state["step"]))
    if group["maximize"]:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(weights, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, weights, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - beta2**step) ** 0.5 for step in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(weights, exp_avgs, denom, [-lr / (1 - beta1**step) for step in steps])
