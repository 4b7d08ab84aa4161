"""One fused Adam / AdamW update per tensor, written for ``torch.compile``.

``adam_tensor_step`` is a pure function of the stored tensors: the gradient (FP8 data and
scales, or a float tensor), Adam's moments (FP32, or low-bit data and scales), the weight
(FP16 with a power-of-two scale, an FP16 master weight, or a float parameter) and 0-d
tensors holding the step's coefficients and noise key. It returns the new stored tensors
and changes nothing. It follows ``LowBitAdam``'s per-tensor reference step operation by
operation, calling the same ``amp8.quant.scaling`` functions, so that compiled (one generated
kernel pass per tensor, plus the amax reductions that the scales need) it agrees with
the reference up to the compiler's reordering of float32 arithmetic.

What stays the same from step to step (dtypes, scale layouts, which branches run) is a
``UpdateSpec``; everything that changes (step counts, learning rate, noise key) is a tensor,
so one compiled graph serves every step. ``FusedAdam`` compiles one graph per update spec with
dynamic shapes, so parameters of different shapes share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, NamedTuple, Union

import torch

from amp8._compiled import compile_privately
from amp8.optim.bound import held_to_bound, ratio_bound
from amp8.optim.state import FIRST_MOMENT_STREAM
from amp8.quant import noise, scaling
from amp8.tensor.stored import encode_fp16


Scalar = Union[float, torch.Tensor]


class Decay(str, Enum):
    """How weight decay enters the step."""

    NONE = "none"
    L2 = "l2"  # Adam: added to the gradient
    DECOUPLED = "decoupled"  # AdamW: the weight shrinks


def decay_of(group: dict[str, Any]) -> Decay:
    """How weight decay enters the steps of a param ``group``."""
    if group["weight_decay"] == 0:
        return Decay.NONE
    return Decay.DECOUPLED if group["decoupled_weight_decay"] else Decay.L2


class WeightKind(str, Enum):
    """What the weight input is and what the step writes back."""

    PLAIN = "plain"  # a float parameter, written back as float32 values
    FP16_SCALED = "fp16_scaled"  # FP16 data * power-of-two scale, stochastic rounding
    MASTER = "master"  # FP16 master (stochastic) plus the FP8 weight re-encoded from it


@dataclass(frozen=True)
class Storage:
    """How one tensor is stored: ``dtype`` None is float32 without scales; otherwise
    data of ``dtype`` with float32 scales: per tensor (``block_size`` 0), per flat block
    of ``block_size`` elements, per row of a matrix (``rows``), or per ``tile`` x ``tile``
    block of a matrix (``tile`` > 0); rounded stochastically (``stochastic``, under the
    step's first-moment noise stream) or to nearest."""

    dtype: torch.dtype | None = None
    block_size: int = 0
    rows: bool = False
    tile: int = 0
    stochastic: bool = False


@dataclass(frozen=True)
class UpdateSpec:
    """Everything about one tensor's update that is fixed between steps."""

    grad: Storage
    exp_avg: Storage
    exp_avg_sq: Storage
    weight: WeightKind
    decay: Decay
    maximize: bool
    # Low-bit moments: the step's ``m / (sqrt(v) + eps)`` is clamped at Adam's bound
    # (``amp8.optim.bound``).
    bounded: bool = False
    # The FP8 weight re-encoded from the master weight (WeightKind.MASTER only).
    fp8_weight: Storage = Storage()
    fp8_margin: int = 0
    fp8_power_of_2: bool = False
    fp8_previous_scale: bool = False


class Tensors(NamedTuple):
    """The stored tensors one update reads; a scale is None where the storage has none."""

    grad: torch.Tensor
    grad_scale: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor | None
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor | None
    weight: torch.Tensor  # FP16 data, FP16 master, or the float parameter
    weight_scale: torch.Tensor | None
    fp8_weight_scale: torch.Tensor | None  # the FP8 weight's current scales (MASTER)


class Coefficients(NamedTuple):
    """The step's scalars, each computed in float64 as the reference step computes it:
    Python floats for an eager step (which then runs torch's own single-tensor Adam
    operations), or 0-d float32 tensors for a compiled one (CPU tensors serve any device;
    one graph then serves every step)."""

    lerp_weight: Scalar  # 1 - beta1
    beta2: Scalar
    one_minus_beta2: Scalar
    neg_step_size: Scalar  # -lr / (1 - beta1**step)
    bias_correction2_sqrt: Scalar  # (1 - beta2**step) ** 0.5
    eps: Scalar
    decay: Scalar  # 1 - lr * weight_decay (decoupled) or weight_decay (L2)
    ratio_bound: Scalar  # amp8.optim.bound.ratio_bound(beta1, beta2, step)


class Result(NamedTuple):
    """The new stored tensors. ``weight`` is float32 values for PLAIN, FP16 data for
    FP16_SCALED, the FP16 master for MASTER; ``fp8_weight`` only for MASTER."""

    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor | None
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor | None
    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    fp8_weight: torch.Tensor | None
    fp8_weight_scale: torch.Tensor | None


def coefficients(group: dict[str, Any], step: float, as_tensors: bool = True) -> Coefficients:
    """The ``Coefficients`` of Adam step number ``step`` (1.0 for the first step) under the
    hyperparameters of a param ``group``, as 0-d float32 tensors (``as_tensors``) or floats."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    weight_decay, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
    values = (
        1 - beta1, beta2, 1 - beta2, -(lr / (1 - beta1**step)), (1 - beta2**step) ** 0.5, eps,
        1 - lr * weight_decay if decoupled else weight_decay, ratio_bound(beta1, beta2, step),
    )
    if not as_tensors:
        return Coefficients(*values)
    return Coefficients(*(torch.tensor(value, dtype=torch.float32) for value in values))


def adam_arithmetic(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, weight: torch.Tensor,
    scalars: Coefficients, *, decay: Decay, maximize: bool, bounded: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam's new ``(exp_avg, exp_avg_sq, weight)`` from float32 values of any shape
    (elementwise: one tensor, or many in one buffer); ``bounded`` holds the step to Adam's
    bound (``amp8.optim.bound``; for low-bit moments). With float ``scalars`` these are the
    operations of ``torch.optim.Adam(foreach=False)`` in its order, so FP32 moments match
    torch's bit for bit; with tensor ``scalars`` the same expressions, written out for
    ``torch.compile``."""
    if maximize:
        grad = -grad
    if decay is Decay.DECOUPLED:
        weight = weight * scalars.decay
    elif decay is Decay.L2:
        grad = _add_product(grad, weight, scalars.decay)
    exp_avg = torch.lerp(exp_avg, grad, scalars.lerp_weight)
    exp_avg_sq = _add_product(exp_avg_sq * scalars.beta2, grad, scalars.one_minus_beta2, grad)
    denom = torch.sqrt(exp_avg_sq) / scalars.bias_correction2_sqrt + scalars.eps
    numerator = held_to_bound(exp_avg, denom, scalars.ratio_bound) if bounded else exp_avg
    if isinstance(scalars.neg_step_size, float):
        weight = torch.addcdiv(weight, numerator, denom, value=scalars.neg_step_size)
    else:
        weight = weight + scalars.neg_step_size * numerator / denom
    return exp_avg, exp_avg_sq, weight


def _add_product(
    x: torch.Tensor, a: torch.Tensor, value: Scalar, b: torch.Tensor | None = None
) -> torch.Tensor:
    """``x + value * a`` (``* b``): torch's ``add(alpha=)`` / ``addcmul`` for a float
    ``value``, the expression for a tensor one."""
    if isinstance(value, float):
        return x.add(a, alpha=value) if b is None else torch.addcmul(x, a, b, value=value)
    return x + value * a if b is None else x + value * a * b


def _load(data: torch.Tensor, scale: torch.Tensor | None, storage: Storage) -> torch.Tensor:
    """float32 values of a stored tensor (as ``amp8.optim.state.load``)."""
    if storage.dtype is None or scale is None:
        return data.float()
    if storage.rows:  # (R, 1) scales broadcast
        return scaling.dequantize(data, scale)
    if storage.tile:
        return scaling.dequantize(data, scaling.expand_scale(scale, tuple(data.shape), storage.tile))
    return scaling.dequantize_blockwise(data, scale, storage.block_size)


def _store(
    value: torch.Tensor, storage: Storage, noise_key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(data, scales)`` storing float32 ``value`` (as ``amp8.optim.state.store``, with
    the step's ``noise_key`` where ``storage`` rounds stochastically)."""
    if storage.dtype is None:
        return value, None
    key = noise.stream_key(noise_key, FIRST_MOMENT_STREAM) if storage.stochastic else None
    if storage.rows:
        scale = scaling.scale_from_amax(value.abs().amax(dim=1, keepdim=True), storage.dtype)
        return scaling.quantize_rounded(value, scale, storage.dtype, key), scale
    if storage.tile:
        return scaling.quantize_tiles(value, storage.dtype, (storage.tile, storage.tile), noise_key=key)
    return scaling.quantize_blockwise(value, storage.dtype, storage.block_size, key)


def _encode_fp8_weight(
    value: torch.Tensor, previous: torch.Tensor | None, spec: UpdateSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight and its scales (as ``StoredWeight.encode`` for FP8 storage)."""
    storage = spec.fp8_weight
    dtype = storage.dtype
    assert dtype is not None  # UpdateSpec construction guarantees it
    if storage.rows:
        amaxes = value.abs().amax(dim=1, keepdim=True)
    elif storage.tile:
        amaxes = scaling.tile_amax(value, (storage.tile, storage.tile))
    else:
        amaxes = scaling.amax(value)
    scale = scaling.scale_from_amax(
        amaxes, dtype, margin=spec.fp8_margin, power_of_2=spec.fp8_power_of_2, previous=previous
    )
    full_scale = scaling.expand_scale(scale, tuple(value.shape), storage.tile)
    return scaling.quantize(value, full_scale, dtype), scale


def adam_tensor_step(
    spec: UpdateSpec, tensors: Tensors, scalars: Coefficients, noise_key: torch.Tensor
) -> Result:
    """One Adam / AdamW update of one tensor; see the module docstring.

    ``noise_key`` (an int64 0-d tensor in ``[0, 2**32)``) drives the stochastic rounding
    of FP16 weights and masters, as in ``scaling.quantize_stochastic``, and under its
    stream ``FIRST_MOMENT_STREAM`` that of an FP8 first moment.
    """
    grad = _load(tensors.grad, tensors.grad_scale, spec.grad)
    exp_avg = _load(tensors.exp_avg, tensors.exp_avg_scale, spec.exp_avg)
    exp_avg_sq = _load(tensors.exp_avg_sq, tensors.exp_avg_sq_scale, spec.exp_avg_sq)
    if spec.weight is WeightKind.PLAIN:
        weight = tensors.weight.float()
    else:
        weight = scaling.dequantize(tensors.weight, tensors.weight_scale)
    exp_avg, exp_avg_sq, weight = adam_arithmetic(
        grad, exp_avg, exp_avg_sq, weight, scalars, decay=spec.decay, maximize=spec.maximize, bounded=spec.bounded
    )
    exp_avg_data, exp_avg_scale = _store(exp_avg, spec.exp_avg, noise_key)
    exp_avg_sq_data, exp_avg_sq_scale = _store(exp_avg_sq, spec.exp_avg_sq, noise_key)
    fp8_weight = fp8_weight_scale = None
    if spec.weight is WeightKind.PLAIN:
        weight_data, weight_scale = weight, None
    else:
        weight_data, weight_scale = encode_fp16(weight, noise_key, previous=tensors.weight_scale)
        if spec.weight is WeightKind.MASTER:
            previous = tensors.fp8_weight_scale if spec.fp8_previous_scale else None
            fp8_weight, fp8_weight_scale = _encode_fp8_weight(weight, previous, spec)
    return Result(
        exp_avg_data, exp_avg_scale, exp_avg_sq_data, exp_avg_sq_scale,
        weight_data, weight_scale, fp8_weight, fp8_weight_scale,
    )


# Inductor otherwise folds ``x.to(float16).float()`` into ``x`` inside a kernel, which
# would skip the rounding that stochastic rounding brackets.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


class FusedAdam:
    """``function(spec, ...)`` compiled once per ``UpdateSpec`` (``torch.compile``, full
    graph, dynamic shapes), for one optimizer: ``adam_tensor_step`` by default, or
    ``amp8.optim.group_step.adam_group_step``. ``compile=False`` runs it eagerly."""

    def __init__(self, compile: bool = True, function: Callable[..., Any] | None = None) -> None:
        self.compile = compile
        self.function = adam_tensor_step if function is None else function
        self._steps: dict[UpdateSpec, Callable[..., Any]] = {}

    def __call__(self, spec: UpdateSpec, *args: Any) -> Any:
        """``function(spec, *args)``, compiled."""
        step = self._steps.get(spec)
        if step is None:
            step = self._steps[spec] = self._build(spec)
        return step(*args)

    def _build(self, spec: UpdateSpec) -> Callable[..., Any]:
        function = self.function

        def step(*args: Any) -> Any:
            return function(spec, *args)

        if not self.compile:
            return step
        # Every spec of every optimizer keeps its own graphs and recompile limit.
        return compile_privately(step, COMPILE_OPTIONS)

    @property
    def specs(self) -> tuple[UpdateSpec, ...]:
        """The update specs compiled so far."""
        return tuple(self._steps)
