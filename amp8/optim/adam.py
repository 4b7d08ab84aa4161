"""``LowBitAdam``: Adam / AdamW that reads FP8 weight gradients and FP16/FP8 weights.

The update of every parameter is computed in float32. Weights of FP8 layers are read
from and written back to their scaled storage through the layer; the state precision
follows the opt level. A step with any non-finite gradient changes nothing and is
counted in ``skipped_steps``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .. import scaling
from ..levels import O1, OptLevel, Precision
from ..nn.linear import Fp8Linear

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
_EXTRA_STATE_KEY = "amp8"


class LowBitAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW (True) for amp8 models.

    Args:
        params: parameters or param groups, as for ``torch.optim.Adam``.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.Adam``.
        decoupled_weight_decay: AdamW's decay (``w *= 1 - lr * weight_decay``) when True.
        level: the opt level whose ``exp_avg`` / ``exp_avg_sq`` columns set state storage.
        fp8_layers: ``{weight Parameter: Fp8Linear}`` for the weights of FP8 layers.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
        level: OptLevel = O1,
        fp8_layers: Mapping[nn.Parameter, Fp8Linear] | None = None,
    ) -> None:
        check_state_precision(level)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
        )
        super().__init__(params, defaults)
        self.level = level
        self.fp8_layers: dict[nn.Parameter, Fp8Linear] = dict(fp8_layers or {})
        self.skipped_steps = 0

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        level: OptLevel,
        fp8_layers: Mapping[nn.Parameter, Fp8Linear],
    ) -> "LowBitAdam":
        """The low-bit equivalent of a ``torch.optim.Adam`` or ``AdamW``: same param
        groups, same hyperparameters.

        Raises:
            TypeError: for any other optimizer class.
            ValueError: for options amp8 does not support (amsgrad, differentiable), an
                optimizer that has already stepped, or one with an LR scheduler attached.
        """
        check_supported(optimizer)
        groups = []
        for group in optimizer.param_groups:
            copied = {key: value for key, value in group.items() if key not in _TORCH_ONLY_KEYS}
            copied.setdefault(
                "decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)
            )
            groups.append(copied)
        defaults = optimizer.defaults
        return cls(
            groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            decoupled_weight_decay=defaults.get(
                "decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)
            ),
            maximize=defaults.get("maximize", False), level=level, fp8_layers=fp8_layers,
        )

    # -- gradients -------------------------------------------------------------------
    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """The float32 gradient of ``param``: its FP8 weight gradient or ``param.grad``."""
        layer = self.fp8_layers.get(param)
        if layer is not None:
            return None if layer.weight_grad is None else layer.weight_grad.dequantize()
        return None if param.grad is None else param.grad.float()

    def stored_gradients(self) -> list[torch.Tensor]:
        """Every gradient as stored (FP8 data or ``param.grad``), for finiteness checks."""
        stored = []
        for group in self.param_groups:
            for param in group["params"]:
                layer = self.fp8_layers.get(param)
                if layer is not None and layer.weight_grad is not None:
                    stored.append(layer.weight_grad.data)
                elif layer is None and param.grad is not None:
                    stored.append(param.grad)
        return stored

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` as torch does, and drop the FP8 weight gradients."""
        super().zero_grad(set_to_none=set_to_none)
        for layer in self.fp8_layers.values():
            layer.weight_grad = None

    # -- weights ---------------------------------------------------------------------
    def read_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The real float32 values of ``param``."""
        layer = self.fp8_layers.get(param)
        return layer.read_weight() if layer is not None else param.detach().float()

    def write_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Store float32 ``value`` into ``param`` (through its layer's scaled storage)."""
        layer = self.fp8_layers.get(param)
        if layer is not None:
            layer.write_weight(value)
        else:
            param.copy_(value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One Adam step over every parameter with a gradient, or none if any overflowed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not bool(scaling.all_finite(self.stored_gradients())):
            self.skipped_steps += 1
            return loss
        for group in self.param_groups:
            for param in group["params"]:
                grad = self.gradient(param)
                if grad is not None:
                    self._update(param, grad, group)
        return loss

    def _update(self, param: nn.Parameter, grad: torch.Tensor, group: dict[str, Any]) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay = group["weight_decay"]
        if group["maximize"]:
            grad = -grad
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        weight = self.read_weight(param)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = float(state["step"])
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                weight.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(weight, alpha=weight_decay)
        # Same operations, in the same order, as torch.optim.Adam(foreach=False).
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-step_size)
        self.write_weight(param, weight)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus amp8's counters."""
        state = super().state_dict()
        state[_EXTRA_STATE_KEY] = {"skipped_steps": self.skipped_steps}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore exactly what ``state_dict()`` saved.

        torch's loader casts floating state to each parameter's dtype, which would round
        float32 moments to the FP16 storage of FP8 layers' weights; amp8 restores them as
        saved instead.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_EXTRA_STATE_KEY, {"skipped_steps": 0})
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        by_id = dict(zip(saved_ids, params))
        for param_id, saved in state_dict["state"].items():
            param = by_id[param_id]
            self.state[param] = {
                key: value.detach().clone().to(param.device) if torch.is_tensor(value) else value
                for key, value in saved.items()
            }
        self.skipped_steps = int(extra["skipped_steps"])


# Options of torch's Adam that LowBitAdam has no use for (implementation choices).
_TORCH_ONLY_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "amsgrad"})


def check_state_precision(level: OptLevel) -> None:
    """Raise ``NotImplementedError`` if this release cannot store ``level``'s Adam state."""
    if level.exp_avg is not Precision.FP32 or level.exp_avg_sq is not Precision.FP32:
        raise NotImplementedError(
            f"opt level {level.name} keeps Adam state in {level.exp_avg.value} + "
            f"{level.exp_avg_sq.value}; this release of amp8 keeps it in FP32 only. "
            "Use opt_level='O1'."
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
