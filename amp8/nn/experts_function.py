"""The autograd Function of ``Fp8Experts``: one expert projection's three grouped GEMMs.

``Fp8Experts`` applies it twice per forward, to the gate-up projection and to the down
projection. Like ``_Fp8LinearFunction`` it receives tensors, the quantizers and a frozen
``LinearGemmConfig``, never the module. Each expert's GEMMs are those an ``Fp8Linear``
with the same recipe runs on that expert's tokens: the same casts, made per expert (one
scale per expert under "tensorwise"), and the same FP8 GEMMs, grouped
(``amp8.ops.grouped_gemm``). The weight gradient leaves as an FP8 ``WeightGrad`` of the
real weight where the weight is stored scaled (``config.fp8_wgrad``), else in the
weight's dtype, as a plain Parameter's.
"""

from __future__ import annotations

from typing import Any

import torch

from amp8.config.gemms import Gemm
from amp8.nn.function import graph_retained
from amp8.nn.gemm_config import LinearGemmConfig
from amp8.nn.quantizer import LinearQuantizers, Quantizer
from amp8.nn.wgrad import cast_wgrad_operands
from amp8.ops.grouped_gemm import (
    ExpertGroups, Operand, expert_matrices, expert_rows, grouped_fp8_gemm, grouped_fp8_wgrad,
)
from amp8.quant.scale_layout import column_major
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad import WeightGrad, WeightGradInFlight

Parts = list[Operand | None]
"""One FP8 operand per expert, None for an expert without tokens."""


def cast_groups(quantizer: Quantizer, x: torch.Tensor, groups: ExpertGroups, contract_dim: int = 1) -> Parts:
    """Each expert's rows of the (``groups.rows``, C) ``x`` cast to FP8 for a GEMM
    contracting their dim ``contract_dim``, with the expert's own scales."""
    return [quantizer.cast(x[groups.group(e)], contract_dim) if e in groups.active else None
            for e in range(groups.num_experts)]


def cast_weights(quantizer: Quantizer, weight: torch.Tensor, groups: ExpertGroups, contract_dim: int) -> Parts:
    """The (N, K) weight of each expert with tokens, from the (E, N, K) ``weight``, cast to
    FP8 for a GEMM contracting its dim ``contract_dim``."""
    return [quantizer.cast(weight[e], contract_dim) if e in groups.active else None
            for e in range(groups.num_experts)]


def _flatten(parts: Parts) -> list[torch.Tensor]:
    """The data and scales of the experts' ``ScaledTensor`` operands, for save_for_backward."""
    present = [part for part in parts if part is not None]
    return [tensor for part in present for tensor in (part.data, part.scale)]  # type: ignore[union-attr]


def _unflatten(tensors: tuple[torch.Tensor, ...], groups: ExpertGroups, block_size: int) -> Parts:
    """``_flatten``'s operands back, None for the experts without tokens."""
    pairs = iter(zip(tensors[0::2], tensors[1::2]))
    return [ScaledTensor(*next(pairs), block_size) if e in groups.active else None for e in range(groups.num_experts)]


class _Fp8ExpertsFunction(torch.autograd.Function):
    """Forward and both backward GEMMs of one expert projection (fprop, dgrad, wgrad).

    Arguments of ``apply``: ``x`` (``groups.rows``, K), the tokens sorted by expert in
    padded groups; ``weight`` (E, N, K), the experts' Parameter (or the grad sink that
    takes its gradient where FSDP2 shards it, see ``Fp8Experts``); ``real``, its real values
    in float32 where it is stored scaled (else None: the Parameter holds them); the
    ``ExpertGroups``; the ``LinearQuantizers`` (casts that record nothing); the
    ``LinearGemmConfig``. Returns (``groups.rows``, N). Tensorwise scales keep the forward's FP8 input for wgrad (as
    ``Recipe(activations="fp8")`` does for finer ones); otherwise the high-precision input
    is kept and re-cast along tokens, per expert, as ``Fp8Linear``'s backward does.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight_param: torch.Tensor,
        real: torch.Tensor | None,
        groups: ExpertGroups,
        quantizers: LinearQuantizers,
        config: LinearGemmConfig,
    ) -> torch.Tensor:
        n = config.out_features
        weight = weight_param if real is None else real
        x8 = w8 = None
        if config.high_fprop:
            y = expert_rows(groups, n, config.out_dtype, x.device,
                            lambda e: (x[groups.group(e)].float() @ weight[e].float().t()).to(config.out_dtype))
        else:
            x8 = cast_groups(quantizers.input, x, groups)
            w8 = cast_weights(quantizers.weight, weight, groups, 1)
            w8_t = [None if w is None else w.t() for w in w8]
            y = grouped_fp8_gemm(x8, w8_t, groups, n, config.out_dtype, Gemm.FPROP)
        ctx.w8_dgrad = None
        if ctx.needs_input_grad[0] and not config.high_dgrad:
            rule = quantizers.weight.rule
            same_tiles = rule.tile(tuple(weight.shape[1:]), 0) == rule.tile(tuple(weight.shape[1:]), 1)
            ctx.w8_dgrad = w8 if w8 is not None and same_tiles else cast_weights(quantizers.weight, weight, groups, 0)
        ctx.x8_block_size = None
        if config.high_wgrad or not (config.tensorwise or config.fp8_saved_input):
            saved = [x]
        else:  # the FP8 input serves wgrad (re-cast along tokens from its values where not tensorwise)
            x8 = cast_groups(quantizers.input, x, groups) if x8 is None else x8
            saved = _flatten(x8)
            ctx.x8_block_size = next(part.block_size for part in x8 if part is not None) if groups.active else 0
        ctx.save_for_backward(*saved, weight if config.high_dgrad else None)
        ctx.groups, ctx.quantizers, ctx.config = groups, quantizers, config
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight_param.dtype
        ctx.grad_class = WeightGradInFlight if isinstance(weight_param, WeightGradInFlight) else WeightGrad
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        config: LinearGemmConfig = ctx.config
        quantizers: LinearQuantizers = ctx.quantizers
        groups: ExpertGroups = ctx.groups
        needs_x, needs_w = ctx.needs_input_grad[:2]
        *saved, weight = ctx.saved_tensors
        g = grad_output.contiguous()  # (rows, N)
        g8 = None
        if (needs_x and not config.high_dgrad) or (needs_w and not config.high_wgrad and config.tensorwise):
            g8 = cast_groups(quantizers.grad_output, g, groups)
        grad_x = grad_w = None
        if needs_x:
            k = config.in_features
            if config.high_dgrad:
                grad_x = expert_rows(groups, k, ctx.x_dtype, g.device,
                                     lambda e: (g[groups.group(e)].float() @ weight[e].float()).to(ctx.x_dtype))
            else:
                w8 = [None if w is None else w.with_data(column_major(w.data)) for w in ctx.w8_dgrad]
                grad_x = grouped_fp8_gemm(g8, w8, groups, k, ctx.x_dtype, Gemm.DGRAD)  # type: ignore[arg-type]
        if needs_w:
            grad_w = _weight_grad(saved, g, g8, groups, quantizers, config, ctx.x8_block_size)
            if config.fp8_wgrad:  # the gradient of the real weight, one byte per element
                grad_w = ctx.grad_class.from_float(  # type: ignore[arg-type]
                    grad_w, config.grad_layout, ctx.weight_dtype, compiled=quantizers.grad_output.compiled
                )
            else:
                grad_w = grad_w.to(ctx.weight_dtype)
        if not graph_retained():  # free the FP8 weights now, as autograd frees saved tensors
            ctx.w8_dgrad = None
        return grad_x, grad_w, None, None, None, None


def _weight_grad(
    saved: list[torch.Tensor],
    g: torch.Tensor,
    g8: Parts | None,
    groups: ExpertGroups,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
    x8_block_size: int | None,
) -> torch.Tensor:
    """The float32 (E, N, K) weight gradients, each expert's ``g_e^T @ x_e`` over its
    tokens: in FP8 (``cast_wgrad_operands`` per expert, one grouped GEMM) unless
    ``config.high_wgrad``. ``saved`` holds the high-precision input, or the flattened FP8
    input parts where ``x8_block_size`` is not None."""
    shape = (config.out_features, config.in_features)
    if x8_block_size is None:
        x = saved[0]
        inputs: list[Any] = [x[groups.group(e)] if e in groups.active else None for e in range(groups.num_experts)]
    else:
        inputs = _unflatten(tuple(saved), groups, x8_block_size)
    if config.high_wgrad:
        return expert_matrices(groups, shape, torch.float32, g.device,
                               lambda e: g[groups.group(e)].float().t() @ inputs[e].float())
    g_parts: Parts = [None] * groups.num_experts
    x_parts: Parts = [None] * groups.num_experts
    outliers: dict[int, torch.Tensor] = {}
    for e in groups.active:
        g8_e = None if g8 is None else g8[e]
        g_parts[e], x_parts[e], split = cast_wgrad_operands(
            inputs[e], g[groups.group(e)], g8_e, quantizers, config  # type: ignore[arg-type]
        )
        if split is not None:
            outliers[e] = split
    grad_w = grouped_fp8_wgrad(g_parts, x_parts, groups, shape)
    for e, contribution in outliers.items():
        grad_w[e] += contribution
    return grad_w
