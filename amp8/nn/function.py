"""The autograd Function of ``Fp8Linear``: its three GEMMs (fprop, dgrad, wgrad).

The Function receives tensors, the layer's ``LinearQuantizers`` (which hold tensors and
frozen settings) and a frozen ``LinearGemmConfig``; never the layer.
"""

from __future__ import annotations

from typing import Any

import torch

from amp8.config.gemms import Gemm
from amp8.nn.gemm_config import LinearGemmConfig
from amp8.nn.quantizer import CastRequest, LinearQuantizers, OperandCast, cast_operands
from amp8.nn.wgrad import real_values, wgrad_casts, wgrad_operands
from amp8.ops.gemm import fp8_gemm, rounded_dtype
from amp8.quant import scaling
from amp8.quant.health import GemmOperand, cast_health
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, is_column_major, pad_rows
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad import GradSlot, WeightGrad, WeightGradInFlight


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward and both backward GEMMs of ``Fp8Linear`` (fprop, dgrad, wgrad).

    Every FP8 operand carries scales along its GEMM's contraction dimension. Tensorwise
    scales serve all three GEMMs, so the forward's FP8 input is kept for wgrad. Finer
    granularities keep the high-precision input and re-cast it (and the output
    gradient) along the token dimension for wgrad; rowwise weights are re-cast per
    column for dgrad, while 128x128 weight blocks serve fprop and dgrad alike.

    Arguments of ``apply``: ``x``; ``weight``, the tensor that takes the weight gradient
    (the Parameter, or a stand-in: see ``SingleStoredWeightModule._grad_target``; None
    where no gradient is needed), and ``bias``; ``w8`` and ``w8_dgrad`` (the FP8 weight for
    fprop and dgrad, or None where that GEMM runs in high precision); ``w_stored`` (the
    stored weight, for the high-precision GEMMs, or None); the ``LinearQuantizers``; the
    ``LinearGemmConfig``; the layer's ``grad_health`` buffer, where the FP8 weight
    gradient's cast writes its signals while watched (``watch_weight_grad``). The FP8
    weight gradient leaves as a ``WeightGrad``, or as a ``WeightGradInFlight`` for a
    stand-in of that type (a compiled graph's).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        w8: ScaledTensor | None,
        w8_dgrad: ScaledTensor | None,
        w_stored: ScaledTensor | None,
        quantizers: LinearQuantizers,
        config: LinearGemmConfig,
        grad_health: torch.Tensor | None = None,
        grad_slot: GradSlot | None = None,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, config.in_features)  # (M, K)
        # Under one scale per tensor the forward's cast serves wgrad too: it writes the
        # transposed copy wgrad reads in the same pass, and that copy is what is saved
        # (unpadded: wgrad pads an M that is not a multiple of GEMM_ALIGNMENT).
        fp8_wgrad_input = ctx.needs_input_grad[1] and not config.high_wgrad and config.tensorwise
        x8 = x8_columns = None
        if not config.high_fprop or fp8_wgrad_input:
            cast = quantizers.input.cast_layouts(
                x2, record=True, update_history=config.update_history, watch=config.input_operands,
                columns=fp8_wgrad_input, replay=config.replay,
            )
            x8, x8_columns = cast.rows, cast.columns
        if config.high_fprop:
            y = (x2.float() @ w_stored.dequantize().t()).to(config.out_dtype)  # type: ignore[union-attr]
        else:
            # The bias joins the GEMM: added to its float32 product, rounded once.
            y = fp8_gemm(x8.with_data(x8.data.contiguous()), w8.t(), config.out_dtype, Gemm.FPROP,  # type: ignore[union-attr]
                         None if bias is None else bias.to(config.out_dtype))
        # A fresh tensor of the output's shape, not a view (torch refuses to change a view
        # made inside a Function in place: ``y += residual``; FSDP2 warns of views).
        y = torch.ops.aten._unsafe_view(y, (*x.shape[:-1], config.out_features))
        if bias is not None and config.high_fprop:  # a new tensor, not a view (FSDP2 warns of views)
            y = y + bias.to(config.out_dtype)
        # The input for wgrad goes through save_for_backward, so saved-tensor hooks see
        # (and count) it: its FP8 data and scales, or the high-precision rows.
        ctx.x8_block_size = None
        if x8_columns is not None:
            ctx.save_for_backward(x8_columns.data, x8_columns.scale, x8_columns.inverse)
            ctx.x8_block_size = 0
        elif config.high_wgrad or not (config.tensorwise or config.fp8_saved_input):
            ctx.save_for_backward(x2)
        else:
            if x8 is None:
                x8 = quantizers.input.cast_layouts(
                    x2, record=True, update_history=config.update_history, watch=config.input_operands,
                    replay=config.replay,
                ).rows
            ctx.save_for_backward(x8.data, x8.scale, x8.inverse)
            ctx.x8_block_size = x8.block_size
        if x8 is None and config.watch_health:
            quantizers.input.watch(x2, 1, config.input_operands)
        ctx.config, ctx.quantizers = config, quantizers
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.grad_class = WeightGradInFlight if isinstance(weight, WeightGradInFlight) else WeightGrad
        ctx.w8_dgrad, ctx.w_stored = w8_dgrad, w_stored
        ctx.grad_health, ctx.grad_slot = grad_health, grad_slot
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        config: LinearGemmConfig = ctx.config
        quantizers: LinearQuantizers = ctx.quantizers
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        g2 = grad_output.reshape(-1, config.out_features)  # (M, N)
        # The backward's casts run together (one call of compiled kernels): the output
        # gradient's for dgrad (one read: its FP8 rows and, under one scale per tensor,
        # the transposed copy for wgrad), and wgrad's own under finer scales.
        fp8_wgrad_grad = needs_w and not config.high_wgrad and config.tensorwise
        grad_cast = (needs_x and not config.high_dgrad) or fp8_wgrad_grad
        requests: list[CastRequest] = []
        if grad_cast:
            requests.append(quantizers.grad_output.request(
                g2, record=True, update_history=config.update_history, watch=config.grad_output_operands,
                columns=fp8_wgrad_grad, padded=fp8_wgrad_grad,
            ))
        elif config.watch_health:
            quantizers.grad_output.watch(g2, 1, config.grad_output_operands)
        wgrad_input = wgrad = None
        if needs_w:
            saved = ctx.saved_tensors
            wgrad_input = saved[0] if ctx.x8_block_size is None else ScaledTensor(
                saved[0], saved[1], ctx.x8_block_size, saved[2]
            )
            if not config.high_wgrad:
                wgrad = wgrad_casts(wgrad_input, g2, quantizers, config)
                requests += wgrad.requests
        casts = cast_operands(tuple(requests))
        g8 = g8_columns = None
        if grad_cast:
            (g8, g8_columns), casts = casts[0], casts[1:]

        grad_x = None
        if needs_x:
            if config.high_dgrad:
                grad_x = (g2.float() @ ctx.w_stored.dequantize()).to(ctx.x_dtype)
            else:
                w8: ScaledTensor = ctx.w8_dgrad  # column-major already where cast for this GEMM alone
                w8_columns = w8.data if is_column_major(w8.data) else column_major(w8.data)
                grad_x = fp8_gemm(
                    g8.with_data(g8.data.contiguous()), w8.with_data(w8_columns),  # type: ignore[union-attr]
                    ctx.x_dtype, Gemm.DGRAD,
                )
            grad_x = grad_x.reshape(ctx.x_shape)

        grad_w = None
        if needs_w:
            outliers = None if wgrad is None else wgrad.outliers
            grad_w = _weight_grad(wgrad_input, g2, g8_columns, casts, outliers, quantizers, config)  # type: ignore[arg-type]
        grad_b = g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if needs_b else None  # no float32 copy of g2
        if not graph_retained():  # free the FP8 weight now, as autograd frees saved tensors
            ctx.w8_dgrad = ctx.w_stored = None
        unused = (None,) * 7  # w8, w8_dgrad, w_stored, quantizers, config, grad_health, grad_slot
        if grad_w is not None:
            if config.weight_transposed:  # the Parameter holds W^T: its gradient is (K, N)
                grad_w = grad_w.t().contiguous()
            if config.fp8_wgrad:  # the gradient of the real weight, one byte per element
                value = grad_w
                grad_w = ctx.grad_class.from_float(
                    value, config.grad_layout, ctx.weight_dtype, compiled=quantizers.grad_output.compiled,
                    slot=ctx.grad_slot,
                )
                if config.watch_health and ctx.grad_health is not None:
                    watch_weight_grad(ctx.grad_health, value, grad_w)
            else:  # FP8 compute only: param.grad in the weight's dtype, as nn.Linear's
                grad_w = grad_w.to(ctx.weight_dtype)
        return (grad_x, grad_w, grad_b, *unused)


def watch_weight_grad(grad_health: torch.Tensor, value: torch.Tensor, grad: WeightGrad) -> None:
    """Keep in ``grad_health`` the largest signals (``amp8.quant.health``) of the FP8
    weight gradient ``grad``'s cast of the float gradient ``value``."""
    data, scale, block_size = grad.parts()
    full_scale = scaling.expand_scale(scale, tuple(value.shape), block_size)
    with torch.no_grad():
        grad_health.copy_(torch.maximum(grad_health, cast_health(value, full_scale, data)))


def graph_retained() -> bool:
    """Whether the running backward keeps the graph for another (``retain_graph=True``),
    which then needs the FP8 weight again; False inside a compiled graph."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def _weight_grad(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    g8: ScaledTensor | None,
    casts: tuple[OperandCast, ...],
    outliers: torch.Tensor | None,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> torch.Tensor:
    """The (N, K) weight gradient ``g2^T @ x2`` (wgrad), float32 or the values the FP8
    GEMM rounded to (``amp8.ops.gemm.rounded_dtype``), from FP8 operands unless
    ``config.high_wgrad``; ``g8`` is the output gradient's tensorwise FP8 cast, ``casts``
    what the GEMM's own casts gave (``amp8.nn.wgrad.wgrad_casts``) and ``outliers`` the
    float32 contribution of the tokens they took out (None where none are).
    ``wgrad_input`` is the forward's FP8 input where it was kept (tensorwise, or
    ``config.fp8_saved_input``), else the high-precision input."""
    if config.high_wgrad:
        if config.watch_health and not config.tensorwise:  # tensorwise: watched with the first casts
            # The casts the FP8 path below would make, padded alike.
            quantizers.grad_output.watch(pad_rows(g2, GEMM_ALIGNMENT), 0, (GemmOperand.WGRAD_GRAD_OUTPUT,))
            quantizers.input.watch(pad_rows(real_values(wgrad_input), GEMM_ALIGNMENT), 0, (GemmOperand.WGRAD_INPUT,))
        return g2.float().t() @ real_values(wgrad_input)
    g_t, x_rows = wgrad_operands(wgrad_input, g8, casts)
    # In the dtype the GEMM rounds to (the values of a float32 result, not converted here).
    grad_w = fp8_gemm(g_t, x_rows, rounded_dtype(g_t, x_rows, torch.float32), Gemm.WGRAD)
    return grad_w if outliers is None else grad_w + outliers
