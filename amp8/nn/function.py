"""The autograd Function of ``Fp8Linear``: its three GEMMs (fprop, dgrad, wgrad).

The Function receives tensors, the layer's ``LinearQuantizers`` (which hold tensors and
frozen settings) and a frozen ``LinearGemmConfig``; never the layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from amp8.config.gemms import Gemm
from amp8.config.recipe import ActivationFormat, Granularity, Recipe
from amp8.nn.quantizer import LinearQuantizers, Quantizer
from amp8.ops.gemm import fp8_gemm, rounded_dtype
from amp8.quant import scaling
from amp8.quant.health import GemmOperand, cast_health
from amp8.quant.scale_layout import GEMM_ALIGNMENT, column_major, is_column_major, pad_rows
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad import GradLayout, GradSlot, WeightGrad, WeightGradInFlight



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
        wgrad_outlier_share: the most tokens, as a share, whose wgrad contribution
            runs in float32 (``Recipe.wgrad_outlier_split``, ``split_outlier_tokens``);
            0 where wgrad does not split.
        weight_transposed: the weight Parameter holds ``W^T``, (K, N) (a ``Conv1D``-like
            layer): the (N, K) weight gradient is handed to autograd transposed, in the
            Parameter's shape.
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
    wgrad_outlier_share: float = 0.0
    weight_transposed: bool = False

    def __post_init__(self) -> None:
        if self.fp8_wgrad and self.grad_layout is None:
            raise ValueError("LinearGemmConfig(fp8_wgrad=True) needs the FP8 weight gradient's grad_layout")

    @classmethod
    def build(
        cls, recipe: Recipe, in_features: int, out_features: int, *,
        fp8_wgrad: bool, update_history: bool, out_dtype: torch.dtype, watch_health: bool = False,
        grad_layout: GradLayout | None = None, weight_transposed: bool = False,
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
            wgrad_outlier_share=recipe.wgrad_outlier_share if recipe.wgrad_outlier_split else 0.0,
            weight_transposed=weight_transposed,
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


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward and both backward GEMMs of ``Fp8Linear`` (fprop, dgrad, wgrad).

    Every FP8 operand carries scales along its GEMM's contraction dimension. Tensorwise
    scales serve all three GEMMs, so the forward's FP8 input is kept for wgrad. Finer
    granularities keep the high-precision input and re-cast it (and the output
    gradient) along the token dimension for wgrad; rowwise weights are re-cast per
    column for dgrad, while 128x128 weight blocks serve fprop and dgrad alike.

    Arguments of ``apply``: ``x``; ``weight``, the tensor that takes the weight gradient
    (the Parameter, or a stand-in: see ``StoredWeightModule._grad_target``; None where
    no gradient is needed), and ``bias``; ``w8`` and ``w8_dgrad`` (the FP8 weight for
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
                columns=fp8_wgrad_input,
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
                x8 = quantizers.input.cast(
                    x2, record=True, update_history=config.update_history, watch=config.input_operands
                )
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
        g8 = g8_columns = None
        fp8_wgrad_grad = needs_w and not config.high_wgrad and config.tensorwise
        if (needs_x and not config.high_dgrad) or fp8_wgrad_grad:
            # One read of the output gradient: its FP8 rows for dgrad and the transposed
            # copy for wgrad (one scale per tensor).
            cast = quantizers.grad_output.cast_layouts(
                g2, record=True, update_history=config.update_history, watch=config.grad_output_operands,
                columns=fp8_wgrad_grad, padded=fp8_wgrad_grad,
            )
            g8, g8_columns = cast.rows, cast.columns
        elif config.watch_health:
            quantizers.grad_output.watch(g2, 1, config.grad_output_operands)

        grad_x = None
        if needs_x:
            if config.high_dgrad:
                grad_x = (g2.float() @ ctx.w_stored.dequantize()).to(ctx.x_dtype)
            else:
                w8: ScaledTensor = ctx.w8_dgrad
                grad_x = fp8_gemm(
                    g8.with_data(g8.data.contiguous()), w8.with_data(column_major(w8.data)),  # type: ignore[union-attr]
                    ctx.x_dtype, Gemm.DGRAD,
                )
            grad_x = grad_x.reshape(ctx.x_shape)

        grad_w = None
        if needs_w:
            saved = ctx.saved_tensors
            wgrad_input = saved[0] if ctx.x8_block_size is None else ScaledTensor(
                saved[0], saved[1], ctx.x8_block_size, saved[2]
            )
            grad_w = _weight_grad(wgrad_input, g2, g8_columns, quantizers, config)
        grad_b = g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if needs_b else None  # no float32 copy of g2
        if not _graph_retained():  # free the FP8 weight now, as autograd frees saved tensors
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


def _graph_retained() -> bool:
    """Whether the running backward keeps the graph for another (``retain_graph=True``),
    which then needs the FP8 weight again; False inside a compiled graph."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def _weight_grad(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    g8: ScaledTensor | None,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> torch.Tensor:
    """The (N, K) weight gradient ``g2^T @ x2`` (wgrad), float32 or the values the FP8
    GEMM rounded to (``amp8.ops.gemm.rounded_dtype``), from FP8 operands unless
    ``config.high_wgrad``; ``g8`` is the output gradient's tensorwise FP8 cast.
    ``wgrad_input`` is the forward's FP8 input where it was kept (tensorwise, or
    ``config.fp8_saved_input``), else the high-precision input."""
    if config.high_wgrad:
        if config.watch_health and not config.tensorwise:  # tensorwise: watched with the first casts
            # The casts the FP8 path below would make, padded alike.
            quantizers.grad_output.watch(pad_rows(g2, GEMM_ALIGNMENT), 0, (GemmOperand.WGRAD_GRAD_OUTPUT,))
            quantizers.input.watch(pad_rows(_real(wgrad_input), GEMM_ALIGNMENT), 0, (GemmOperand.WGRAD_INPUT,))
        return g2.float().t() @ _real(wgrad_input)
    g_t, x_rows, outliers = wgrad_operands(wgrad_input, g2, g8, quantizers, config)
    # In the dtype the GEMM rounds to (the values of a float32 result, not converted here).
    grad_w = fp8_gemm(g_t, x_rows, rounded_dtype(g_t, x_rows, torch.float32), Gemm.WGRAD)
    return grad_w if outliers is None else grad_w + outliers


def wgrad_operands(
    wgrad_input: torch.Tensor | ScaledTensor,
    g2: torch.Tensor,
    g8: ScaledTensor | None,
    quantizers: LinearQuantizers,
    config: LinearGemmConfig,
) -> tuple[ScaledTensor, ScaledTensor, torch.Tensor | None]:
    """The FP8 operands of the weight-gradient GEMM ``g2^T @ x2`` and the float32
    contribution of the outlier tokens it takes out (None where it splits none).

    Args:
        wgrad_input: the forward's FP8 input (M, K) where it was kept, else the
            high-precision input.
        g2: the (M, N) output gradient.
        g8: its tensorwise FP8 cast (tensorwise recipes), else None; row-major, or
            padded and column-major as ``padded_columns`` gives it.
        quantizers: the casts of each role.
        config: the GEMMs' config (``config.high_wgrad`` False).

    Returns:
        ``(g_t, x_columns, outliers)``: the (N, M') output gradient, row-major, and the
        (M', K) input, column-major, with M' = M padded with zero rows to a multiple of
        ``GEMM_ALIGNMENT``; scales along M except under one scale per tensor.
    """
    outliers = None
    if config.tensorwise:
        g_columns = padded_columns(g8)  # type: ignore[arg-type]
        x_columns = padded_columns(wgrad_input)  # type: ignore[arg-type]
    else:  # scales along the token dim M, which wgrad contracts
        x2 = _real(wgrad_input)  # the forward's FP8 input is re-cast from its values
        if config.wgrad_outlier_share:
            outliers, x2, g2 = split_outlier_tokens(x2, g2, config.wgrad_outlier_share)
        g_columns = _padded_columns_cast(quantizers.grad_output, g2, config.watched(GemmOperand.WGRAD_GRAD_OUTPUT))
        x_columns = _padded_columns_cast(quantizers.input, x2, config.watched(GemmOperand.WGRAD_INPUT))
    return g_columns.t(), x_columns, outliers


def padded_columns(x8: ScaledTensor) -> ScaledTensor:
    """The (M, K) FP8 operand ``x8`` with zero rows appended to a multiple of
    ``GEMM_ALIGNMENT``, column-major: as a cast with ``columns`` writes it for an aligned
    M (then returned as it is), else copied so."""
    data = x8.data
    if data.shape[0] % GEMM_ALIGNMENT == 0 and is_column_major(data):
        return x8
    return x8.with_data(column_major(pad_rows(data, GEMM_ALIGNMENT)))


def _padded_columns_cast(quantizer: Quantizer, x2: torch.Tensor, watch: tuple[GemmOperand, ...]) -> ScaledTensor | BlockScaledTensor:
    """``x2`` padded with zero rows to a multiple of ``GEMM_ALIGNMENT``, cast with scales
    along its rows (the tokens wgrad contracts), column-major."""
    return quantizer.cast_layouts(x2, 0, watch=watch, rows=False, columns=True, padded=True).columns  # type: ignore[return-value]


OUTLIER_ROW_RATIO = 2.0**8
"""A token row is an outlier where its amax exceeds the median row amax of its operand
(over the rows that are not all zero) more than this many times. A row ``2**r`` above
the others pushes them ``r`` binades down a scale along tokens: E4M3 flushes 1 % of a
GELU output's values from about ``r = 10`` on (the controller's threshold), so the
split takes such rows with four times to spare, while rows of healthy activations and
gradients stay within a few binades of the median."""


def split_outlier_tokens(
    x2: torch.Tensor, g2: torch.Tensor, share: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take the outlier tokens out of a weight-gradient GEMM ``g2^T @ x2`` (x2: (M, K),
    g2: (M, N)): the rows whose amax in either operand exceeds that operand's median
    row amax more than ``OUTLIER_ROW_RATIO`` times, at most ``ceil(share * M)`` of them
    (the largest). Returns their float32 contribution ``(N, K)`` and both operands with
    their rows zeroed, so the FP8 GEMM of the rest, plus the contribution, is the whole
    product; with no outlier row the operands are returned unchanged and the
    contribution is zero.

    The float32 product runs over the ``ceil(share * M)`` candidate rows with the
    largest ratio, those that are not outliers zeroed: the shapes depend on M alone,
    so compiled graphs keep static shapes, and the count of rows taken out follows the
    batch."""
    window = min(x2.shape[0], math.ceil(share * x2.shape[0]))
    score = torch.fmax(_relative_row_amax(x2), _relative_row_amax(g2))
    rows = score.topk(window, sorted=False).indices.sort().values  # in token order, as the GEMM sums
    taken = score.index_select(0, rows) > OUTLIER_ROW_RATIO  # (window,)
    g_taken = torch.where(taken[:, None], g2.index_select(0, rows).float(), 0.0)
    x_taken = torch.where(taken[:, None], x2.index_select(0, rows).float(), 0.0)
    outliers = g_taken.t() @ x_taken
    drop = torch.zeros(x2.shape[0], dtype=torch.bool, device=x2.device).index_copy(0, rows, taken)[:, None]
    return outliers, x2.masked_fill(drop, 0), g2.masked_fill(drop, 0)


def _relative_row_amax(x2: torch.Tensor) -> torch.Tensor:
    """Each row's amax over the median amax of the rows that are not all zero (float32;
    NaN where every row is zero, which no comparison takes)."""
    amax = x2.abs().amax(1).float()
    median = torch.where(amax > 0, amax, torch.nan).nanmedian()
    return amax / median


def _real(x: torch.Tensor | ScaledTensor) -> torch.Tensor:
    """The values of ``x`` in float32, dequantized where it is FP8 with its scales."""
    return x.dequantize() if isinstance(x, ScaledTensor) else x.float()


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would return for ``x``: autocast's where it is on."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
