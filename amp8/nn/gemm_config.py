"""What one call of an FP8 GEMM layer's autograd Function needs besides its tensors:
``LinearGemmConfig``, a small frozen config built from the layer's GEMM recipe each
forward (``Fp8Linear``'s Function and ``Fp8Experts``' take it, never the layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amp8.config.recipe import ActivationFormat, Granularity, Recipe
from amp8.nn.outlier_split import token_share
from amp8.quant.health import GemmOperand
from amp8.tensor.weight_grad import GradLayout


@dataclass(frozen=True)
class LinearGemmConfig:
    """What one call of ``_Fp8LinearFunction`` needs to know besides its tensors.

    Attributes:
        in_features: K, the input's last dim.
        out_features: N, the output's last dim.
        high_fprop: the forward GEMM runs in float32 on the real weight.
        high_dgrad: the input-gradient GEMM runs in float32 on the real weight.
        high_wgrad: the weight-gradient GEMM runs in float32.
        tensorwise: one scale per tensor, so the forward's FP8 input serves wgrad too.
        fp8_wgrad: the weight gradient leaves backward in FP8, a ``WeightGrad`` at
            ``grad_layout``; otherwise in the weight's dtype, as ``nn.Linear``'s.
        fp8_saved_input: finer-than-tensorwise granularities keep the forward's FP8
            input for wgrad (re-cast along tokens from its values) instead of the
            high-precision input (``Recipe(activations="fp8")``).
        update_history: casts that record a scale also push their amax to the history
            (the layer is training).
        out_dtype: the dtype of the output.
        watch_health: every GEMM operand's cast (or, for a GEMM in high precision, the
            cast it would get) writes its health signals (see ``amp8.quant.health``).
        grad_layout: how the FP8 weight gradient is stored (the stored weight's
            ``grad_layout``); None where it is not FP8.
        wgrad_outlier_share: the most tokens, as a ratio of ints (``token_share``),
            whose wgrad contribution runs in float32 (``Recipe.wgrad_outlier_split``,
            ``split_outlier_tokens``); None where wgrad does not split.
        weight_transposed: the weight Parameter holds ``W^T``, (K, N) (a ``Conv1D``-like
            layer): the (N, K) weight gradient is handed to autograd transposed, in the
            Parameter's shape.
        replay: the forward runs again in backward (activation checkpointing): its casts
            repeat the first forward's and record nothing (``CastSpec.replay``).
    """

    in_features: int
    out_features: int
    high_fprop: bool
    high_dgrad: bool
    high_wgrad: bool
    tensorwise: bool
    fp8_wgrad: bool
    fp8_saved_input: bool
    update_history: bool
    out_dtype: torch.dtype
    watch_health: bool = False
    grad_layout: GradLayout | None = None
    wgrad_outlier_share: tuple[int, int] | None = None
    weight_transposed: bool = False
    replay: bool = False

    def __post_init__(self) -> None:
        if self.fp8_wgrad and self.grad_layout is None:
            raise ValueError("LinearGemmConfig(fp8_wgrad=True) needs the FP8 weight gradient's grad_layout")

    @classmethod
    def build(
        cls, recipe: Recipe, in_features: int, out_features: int, *,
        fp8_wgrad: bool, update_history: bool, out_dtype: torch.dtype, watch_health: bool = False,
        grad_layout: GradLayout | None = None, weight_transposed: bool = False, replay: bool = False,
    ) -> "LinearGemmConfig":
        """The config of one call of a layer with ``recipe`` and an (N, K) weight
        (``grad_layout``: see the attribute; the recipe's, for its shape, when None)."""
        if fp8_wgrad and grad_layout is None:
            shape = (in_features, out_features) if weight_transposed else (out_features, in_features)
            grad_layout = GradLayout.for_weight(recipe, shape)
        high_fprop, high_dgrad, high_wgrad = recipe.override_linear_precision
        return cls(
            in_features=in_features,
            out_features=out_features,
            high_fprop=high_fprop,
            high_dgrad=high_dgrad,
            high_wgrad=high_wgrad,
            tensorwise=recipe.granularity is Granularity.TENSORWISE,
            fp8_wgrad=fp8_wgrad,
            fp8_saved_input=recipe.activations is ActivationFormat.FP8,
            update_history=update_history,
            out_dtype=out_dtype,
            watch_health=watch_health,
            grad_layout=grad_layout if fp8_wgrad else None,
            wgrad_outlier_share=token_share(recipe.wgrad_outlier_share) if recipe.wgrad_outlier_split else None,
            weight_transposed=weight_transposed,
            replay=replay,
        )

    def watched(self, *operands: GemmOperand) -> tuple[GemmOperand, ...]:
        """``operands`` while health is watched, else none."""
        return operands if self.watch_health else ()

    @property
    def input_operands(self) -> tuple[GemmOperand, ...]:
        """The operands the input's forward cast serves: the weight-gradient GEMM's too
        under one scale per tensor, where that cast is reused."""
        if self.tensorwise:
            return self.watched(GemmOperand.FPROP_INPUT, GemmOperand.WGRAD_INPUT)
        return self.watched(GemmOperand.FPROP_INPUT)

    @property
    def grad_output_operands(self) -> tuple[GemmOperand, ...]:
        """The operands the output gradient's first cast serves (as ``input_operands``)."""
        if self.tensorwise:
            return self.watched(GemmOperand.DGRAD_GRAD_OUTPUT, GemmOperand.WGRAD_GRAD_OUTPUT)
        return self.watched(GemmOperand.DGRAD_GRAD_OUTPUT)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would return for ``x``: autocast's where it is on."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
