"""``Fp8Linear``: ``y = x W^T + b`` with all three GEMMs in FP8.

The layer reuses the caller's ``weight`` and ``bias`` Parameters. The weight's data is
stored as FP16 (O1, O2) or FP8 (O3) holding ``w * weight_scale``; ``weight_scale`` is a
buffer beside it. ``layer.stored_weight`` (an ``amp8.StoredWeight``) is the one place that
knows that storage, and where the weight gradient goes: backward hands each new FP8 weight
gradient to it, and it lands in ``weight.grad`` as a ``WeightGrad`` (FP8 data + scales,
the gradient of the real weight), where torch's ``zero_grad`` and ``clip_grad_norm_`` find
it. See DESIGN.md, "Weight gradients".
"""

from __future__ import annotations

import warnings
from enum import IntEnum
from typing import Any, Callable

import torch
from torch import nn

from .. import scaling
from ..formats import forward_dtype, gradient_dtype
from ..gemm import GemmRole, fp8_gemm
from ..levels import Precision
from ..recipe import Granularity, Recipe, Scaling
from ..checks import check_loaded_history, check_loaded_scales
from ..stored_weight import StoredWeight, stored_weight
from ..tensor import ScaledTensor

_GEMM_ALIGNMENT = 16
class Slot(IntEnum):
    """Rows of a layer's ``scale`` and ``amax_history`` buffers."""

    INPUT = 0
    WEIGHT = 1
    GRAD_OUTPUT = 2


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Append zero rows to a matrix (FP8 or not) so its row count is a multiple of
    ``multiple``."""
    missing = -x.shape[0] % multiple
    if missing == 0:
        return x
    # FP8 tensors are concatenated as their bytes (a zero byte is +0.0 in both formats).
    raw = x.view(torch.uint8) if x.element_size() == 1 and x.dtype.is_floating_point else x
    return torch.cat([raw, raw.new_zeros(missing, x.shape[1])]).view(x.dtype)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (a transposed contiguous copy, transposed)."""
    return x.t().contiguous().t()


class Fp8Linear(nn.Module):
    """A linear layer whose forward, input-gradient and weight-gradient GEMMs run in FP8.

    Build one with ``Fp8Linear.from_linear(linear, recipe, weight_storage)``; it takes
    over the ``nn.Linear``'s Parameter objects, so an optimizer that holds them still
    points at the right tensors.

    Buffers (saved in ``state_dict``):
        weight_scale: float32, ``weight.data == w * weight_scale``: a scalar for FP16
            storage; for FP8 storage the weight's scales at the recipe's granularity
            (a scalar, (N, 1) per row, or (ceil(N / b), ceil(K / b)) per block).
        scale: (3,) float32, the FP8 scale last used for input, weight, grad_output
            (the smallest of a tensor's scales under fine-grained granularities).
        amax_history: (3, L) float32, newest first; L is 1 under current scaling.

    amp8's own tensors keep their dtypes through ``model.to(dtype)``, ``.half()`` and
    ``.bfloat16()``: scales and histories stay float32 and the weight stays in its FP16 or
    FP8 storage (the bias follows the cast, as in any module).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        recipe: Recipe,
        weight_storage: Precision = Precision.FP16,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.recipe = recipe
        device = weight.device
        self.register_buffer("weight_scale", torch.ones((), device=device))
        self.register_buffer("scale", torch.ones(len(Slot), device=device))
        self.register_buffer("amax_history", torch.zeros(len(Slot), recipe.history_len, device=device))
        real_weight = weight.detach().float()
        self.weight = weight
        self.bias = bias
        # FP8 copies of an FP16 weight, by the dim their GEMM contracts; see ``fp8_weight``.
        self._weight_cache: dict[int, ScaledTensor] = {}
        self.stored_weight = StoredWeight(self, recipe, weight_storage, self.drop_weight_cache)
        # Backward writes the scales of each new FP8 weight gradient here, in place, and
        # returns its data as the gradient of ``_grad_sink``; see ``_new_weight_grad``.
        self.register_buffer(
            "_grad_scale", torch.ones(self.stored_weight.grad_scale_shape, device=device), persistent=False
        )
        self._make_grad_sink()
        self.stored_weight.write(real_weight)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, weight_storage: Precision = Precision.FP16
    ) -> "Fp8Linear":
        """Swap-in for ``linear`` that reuses its Parameters (their data is re-stored)."""
        layer = cls(linear.weight, linear.bias, recipe, weight_storage)
        layer.train(linear.training)
        return layer

    # -- the weight gradient's way out of backward -------------------------------------
    def _make_grad_sink(self) -> None:
        """A leaf that holds no memory (one element, expanded to the weight's shape) and
        requires grad: backward returns each new FP8 weight gradient as its gradient, and
        its hook, which runs eagerly also after a compiled backward, hands it on. The
        gradient cannot be returned for the weight itself: autograd would cast it to the
        weight's dtype."""
        dtype = self.stored_weight.grad_dtype
        sink = torch.zeros((), dtype=dtype, device=self.weight_scale.device).expand(self.weight.shape)
        sink.requires_grad_(True)
        sink.register_post_accumulate_grad_hook(self._new_weight_grad)
        self._grad_sink = sink

    def _new_weight_grad(self, sink: torch.Tensor) -> None:
        data, sink.grad = sink.grad, None
        self.stored_weight.add_grad(data, self._grad_scale.clone())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_grad_sink", None)  # a leaf with a hook does not pickle; rebuilt below
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._make_grad_sink()
        if self.weight_storage is not Precision.AS_IS:  # a copied Parameter loses its mark
            self.stored_weight.mark(self.weight)

    # -- weight storage (see ``amp8.StoredWeight``) ------------------------------------
    @property
    def weight_storage(self) -> Precision:
        """How the weight is stored: ``Precision.FP16`` or ``Precision.FP8``."""
        return self.stored_weight.storage

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weight is stored in (float16 or float8_e4m3fn)."""
        return self.stored_weight.dtype

    @property
    def block_size(self) -> int:
        """Elements per block edge of this layer's scales (0 unless the recipe is "block")."""
        return self.stored_weight.block_size

    def read_weight(self) -> torch.Tensor:
        """The weight's real values in float32 (this rank's rows, outside forward and
        backward, when FSDP2 shards the weight: see ``amp8.comm.fsdp``)."""
        return self.stored_weight.read()

    def write_weight(self, real_weight: torch.Tensor, noise_key: torch.Tensor | int | None = None) -> None:
        """Store ``real_weight`` (any float dtype) into the weight Parameter, in place,
        rounded stochastically under ``noise_key`` when one is given."""
        self.stored_weight.write(real_weight, noise_key)

    def weight_tile(self, contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile of the weight's FP8 scales for a GEMM contracting its dim
        ``contract_dim`` (1: the forward GEMM, 0: the input-gradient GEMM)."""
        return self.stored_weight.tile(contract_dim)

    def set_weight_storage(self, weight_storage: Precision) -> None:
        """Re-store the weight as FP16 or FP8 (O3 keeps FP8 weights beside FP16 masters)."""
        self.stored_weight.restore(weight_storage)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (another opt level, or a
        plain ``nn.Linear``) and filling scale buffers such a checkpoint lacks."""
        weight_key, scale_key = prefix + "weight", prefix + "weight_scale"
        saved, saved_scale = state_dict.get(weight_key), state_dict.get(scale_key)
        if saved_scale is not None:
            check_loaded_scales(scale_key, saved_scale)
        if state_dict.get(prefix + "scale") is not None:
            check_loaded_scales(prefix + "scale", state_dict[prefix + "scale"])
        if state_dict.get(prefix + "amax_history") is not None:
            check_loaded_history(prefix + "amax_history", state_dict[prefix + "amax_history"])
        if saved is not None and (
            saved.dtype != self.weight.dtype
            or saved_scale is None
            or saved_scale.shape != self.weight_scale.shape
        ):
            if saved_scale is None:
                saved_scale = torch.ones((), device=saved.device)
            real = ScaledTensor(saved, saved_scale.to(saved.device), self.recipe.block_size).dequantize()
            state_dict[weight_key], state_dict[scale_key] = self.stored_weight.encode(real.to(self.weight.device))
            warnings.warn(
                f"amp8: converted {weight_key} from {saved.dtype} to {self.weight_dtype} storage "
                f"(scales of shape {tuple(saved_scale.shape)} to {tuple(state_dict[scale_key].shape)})",
                stacklevel=2,
            )
        for key, buffer in ((prefix + "scale", self.scale), (prefix + "amax_history", self.amax_history)):
            saved_buffer = state_dict.get(key)
            if saved_buffer is None:
                state_dict[key] = buffer.clone()
            elif saved_buffer.shape != buffer.shape:  # another amax_history_len
                resized = torch.zeros_like(buffer)
                length = min(saved_buffer.shape[-1], buffer.shape[-1])
                resized[..., :length] = saved_buffer[..., :length]
                state_dict[key] = resized
        self.drop_weight_cache()
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Fp8Linear":
        """``.to()``, ``.cuda()``, ``.half()`` and friends: move amp8's tensors to the new
        device, keeping their dtypes (a float32 scale of 2**17 would be inf in FP16)."""
        self.drop_weight_cache()
        kept = {name: (buffer, buffer.dtype) for name, buffer in self._buffers.items() if buffer is not None}
        weight_dtype, stored = self.weight.dtype, self.weight.data
        super()._apply(fn, recurse)
        device = self.weight.device
        for name, (original, dtype) in kept.items():
            buffer = self._buffers[name]
            if buffer is not None and buffer.dtype != dtype:
                self._buffers[name] = original.to(device)
        if self.weight.dtype != weight_dtype and self.weight_storage is not Precision.AS_IS:
            self.weight.data = stored.to(device)
        if self._grad_sink.device != device:
            self._make_grad_sink()
        return self

    # -- FP8 scales ------------------------------------------------------------------
    def fp8_dtype(self, slot: Slot) -> torch.dtype:
        """The FP8 dtype the tensor in ``slot`` is cast to for a GEMM."""
        fmt = self.recipe.fp8_format
        return gradient_dtype(fmt) if slot is Slot.GRAD_OUTPUT else forward_dtype(fmt)

    def tile(self, slot: Slot, shape: tuple[int, ...], contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile sharing one scale when a tensor of ``shape`` in ``slot`` is cast for a
        GEMM contracting its dim ``contract_dim``; None for one scale per tensor."""
        return self.recipe.tile(shape, contract_dim, weight=slot is Slot.WEIGHT)

    def next_scale(
        self, slot: Slot, x: torch.Tensor, contract_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` the next cast of ``x`` in ``slot`` would use; changes nothing.

        Current scaling takes the scale from ``amax(x)`` (per tile under fine-grained
        granularities, see ``tile``; ``amax`` is then the largest of them). Delayed
        scaling takes it from the amax history, falling back to ``amax(x)`` while the
        history is still empty. No scaling always gives 1.
        """
        recipe = self.recipe
        dtype = self.fp8_dtype(slot)
        tile = self.tile(slot, tuple(x.shape), contract_dim)
        amaxes = scaling.tile_amax(x, tile)
        current_amax = amaxes.amax()
        if recipe.scaling is Scaling.NONE:
            return torch.ones_like(amaxes), current_amax
        previous = self.scale[slot] if tile is None else None
        fresh = scaling.scale_from_amax(
            amaxes, dtype, margin=recipe.margin, power_of_2=recipe.power_of_2_scales,
            previous=previous,
        )
        if recipe.scaling is Scaling.CURRENT:
            return fresh, current_amax
        history = self.amax_history[slot]
        delayed = scaling.scale_from_amax(
            scaling.history_amax(history, recipe.amax_compute_algo), dtype,
            margin=recipe.margin, power_of_2=recipe.power_of_2_scales, previous=previous,
        )
        return torch.where(history.amax() > 0, delayed, fresh), current_amax

    def cast(
        self, slot: Slot, x: torch.Tensor, contract_dim: int = 1, *, record: bool = True
    ) -> ScaledTensor:
        """Cast the 2-D ``x`` to FP8 for ``slot`` and a GEMM contracting its dim
        ``contract_dim``. With ``record``, the scale (the smallest, under fine-grained
        granularities) goes to the ``scale`` buffer and, in training, the amax to the
        history; the re-casts for the transposed backward GEMMs do not record."""
        scale, current_amax = self.next_scale(slot, x, contract_dim)
        if record and x.numel() > 0:  # an empty batch says nothing about the range
            with torch.no_grad():
                self.scale[slot] = scale.amin()
                if self.training:
                    finite_amax = torch.where(torch.isfinite(current_amax), current_amax, 0.0)
                    self.amax_history[slot] = scaling.push_history(self.amax_history[slot], finite_amax)
        full_scale = scaling.expand_scale(scale, tuple(x.shape), self.block_size)
        return ScaledTensor(scaling.quantize(x, full_scale, self.fp8_dtype(slot)), scale, self.block_size)

    def fp8_weight(self, contract_dim: int = 1) -> ScaledTensor:
        """The (N, K) weight as the FP8 GEMMs get it, with scales for a GEMM contracting
        its dim ``contract_dim``: the stored FP8 weight at O3 where its scales fit, else a
        cast (from the FP8 weight's real values at O3: rowwise scales along the other
        dim, for the input-gradient GEMM).

        The cast of an FP16 weight is cached until the weight is next written
        (``write_weight``, the optimizer's step, ``load_state_dict``, ``.to()``), so the
        micro-batches of gradient accumulation cast it once per optimizer step. Call
        ``drop_weight_cache()`` after changing ``weight`` in place by other means.
        """
        if self.weight_storage is Precision.AS_IS:  # the user's optimizer writes it: no cache
            return self.cast(Slot.WEIGHT, self.read_weight(), contract_dim, record=contract_dim == 1)
        if self.weight_storage is Precision.FP8:
            stored = self.stored_weight.stored()
            if self.weight_tile(contract_dim) == self.weight_tile():
                return stored
            return self.cast(Slot.WEIGHT, stored.dequantize(), contract_dim, record=False)
        cached = self._weight_cache.get(contract_dim)
        if cached is None:
            cached = self.cast(Slot.WEIGHT, self.read_weight(), contract_dim, record=contract_dim == 1)
            self._weight_cache[contract_dim] = cached
        return cached

    def drop_weight_cache(self) -> None:
        """Forget the cached FP8 casts of the weight (see ``fp8_weight``)."""
        self._weight_cache.clear()

    # -- weight gradient -------------------------------------------------------------
    @property
    def weight_grad(self) -> ScaledTensor | None:
        """The weight gradient as FP8 + scales (tiled like the weight's FP8 scales under
        fine-grained granularities), or None: the FP8 tensors inside ``weight.grad`` (see
        ``amp8.StoredWeight.grad``). Assign None to clear it, or a ``ScaledTensor`` of the
        gradient's dtype, shape and scale layout to replace it."""
        return self.stored_weight.grad()

    @weight_grad.setter
    def weight_grad(self, value: ScaledTensor | None) -> None:
        self.stored_weight.set_grad(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` of shape (..., in_features)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8Linear expects inputs of shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        if not torch.compiler.is_compiling():
            self._check_weight_is_amp8s()
        high_fprop, high_dgrad, _ = self.recipe.override_linear_precision
        # The weight's FP8 casts happen here, outside the autograd.Function, so that the
        # cache (a module attribute) is written where a compiled graph may write it.
        w8 = self.fp8_weight() if not (high_fprop and high_dgrad) else None  # (N, K)
        w8_dgrad = w8
        needs_dgrad = torch.is_grad_enabled() and x.requires_grad and not high_dgrad
        if needs_dgrad and self.weight_tile(0) != self.weight_tile(1):
            w8_dgrad = self.fp8_weight(contract_dim=0)  # rowwise: scales per column
        sink = self._grad_sink if self.weight.requires_grad and self.weight_storage is not Precision.AS_IS else None
        out_dtype = _output_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the GEMMs choose their own dtypes
            return _Fp8LinearFunction.apply(x, self.weight, self.bias, self, w8, w8_dgrad, sink, out_dtype)

    def _check_weight_is_amp8s(self) -> None:
        """Refuse a weight Parameter amp8 did not place: a ``fully_shard`` (or other
        wrapper) applied after ``amp8.initialize`` would reduce a gradient it cannot read."""
        handle = self.stored_weight
        if handle.sharded or handle.storage is Precision.AS_IS or stored_weight(self.weight) is handle:
            return
        raise RuntimeError(
            "the weight of an Fp8Linear was replaced after amp8.initialize (by fully_shard, "
            "or by assigning a new Parameter); for FSDP2 use opt_level='O3' in a process "
            "group, where amp8 applies fully_shard itself, or DistributedDataParallel at "
            "O1/O2, wrapped after amp8.initialize"
        )

    def extra_repr(self) -> str:
        """Shape, weight storage and recipe, for ``print(model)``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.weight_dtype}, "
            f"format={self.recipe.fp8_format.value}, scaling={self.recipe.scaling.value}, "
            f"granularity={self.recipe.granularity.value}"
        )


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward and both backward GEMMs of ``Fp8Linear`` (fprop, dgrad, wgrad).

    Every FP8 operand carries scales along its GEMM's contraction dimension. Tensorwise
    scales serve all three GEMMs, so the forward's FP8 input is kept for wgrad. Finer
    granularities keep the high-precision input and re-cast it (and the output
    gradient) along the token dimension for wgrad; rowwise weights are re-cast per
    column for dgrad, while 128x128 weight blocks serve fprop and dgrad alike.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: nn.Parameter,
        bias: torch.Tensor | None,
        layer: Fp8Linear,
        w8: ScaledTensor | None,
        w8_dgrad: ScaledTensor | None,
        grad_sink: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        high_fprop, high_dgrad, high_wgrad = layer.recipe.override_linear_precision
        tensorwise = layer.recipe.granularity is Granularity.TENSORWISE
        x2 = x.reshape(-1, layer.in_features)  # (M, K)
        x8 = None
        if high_fprop:
            y = (x2.float() @ layer.read_weight().t()).to(out_dtype)
        else:
            x8 = layer.cast(Slot.INPUT, x2)
            y = fp8_gemm(x8.with_data(x8.data.contiguous()), w8.t(), out_dtype, GemmRole.FPROP)
        y = y.view(*x.shape[:-1], layer.out_features)
        if bias is not None:  # the sum is a new tensor, not a view (FSDP2 warns of views)
            y = y + bias.to(out_dtype)
        if high_wgrad or not tensorwise:
            wgrad_input = x2
        else:
            wgrad_input = x8 if x8 is not None else layer.cast(Slot.INPUT, x2)
        ctx.layer = layer
        ctx.plain_wgrad = layer.weight_storage is Precision.AS_IS
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.weight_dtype = weight.dtype
        ctx.w8_dgrad = w8_dgrad
        ctx.wgrad_input = wgrad_input
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        layer: Fp8Linear = ctx.layer
        high_fprop, high_dgrad, high_wgrad = layer.recipe.override_linear_precision
        tensorwise = layer.recipe.granularity is Granularity.TENSORWISE
        needs_x, needs_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        needs_w = ctx.needs_input_grad[1] if ctx.plain_wgrad else ctx.needs_input_grad[6]
        g2 = grad_output.reshape(-1, layer.out_features)  # (M, N)
        g8 = None
        if (needs_x and not high_dgrad) or (needs_w and not high_wgrad and tensorwise):
            g8 = layer.cast(Slot.GRAD_OUTPUT, g2)

        grad_x = None
        if needs_x:
            if high_dgrad:
                grad_x = (g2.float() @ layer.read_weight()).to(ctx.x_dtype)
            else:
                w8: ScaledTensor = ctx.w8_dgrad
                grad_x = fp8_gemm(
                    g8.with_data(g8.data.contiguous()), w8.with_data(_column_major(w8.data)),
                    ctx.x_dtype, GemmRole.DGRAD,
                )
            grad_x = grad_x.reshape(ctx.x_shape)

        if needs_w:
            if high_wgrad:
                grad_w = g2.float().t() @ ctx.wgrad_input.float()
            else:
                if tensorwise:
                    x8: ScaledTensor = ctx.wgrad_input
                    g_rows = g8.with_data(_pad_rows(g8.data, _GEMM_ALIGNMENT))
                    x_rows = x8.with_data(_pad_rows(x8.data, _GEMM_ALIGNMENT))
                else:  # scales along the token dim M, which wgrad contracts
                    g_rows = layer.cast(Slot.GRAD_OUTPUT, _pad_rows(g2, _GEMM_ALIGNMENT), 0, record=False)
                    x_rows = layer.cast(Slot.INPUT, _pad_rows(ctx.wgrad_input, _GEMM_ALIGNMENT), 0, record=False)
                g_t = g_rows.t()  # (N, M)
                grad_w = fp8_gemm(
                    g_t.with_data(g_t.data.contiguous()), x_rows.with_data(_column_major(x_rows.data)),
                    torch.float32, GemmRole.WGRAD,
                )

        grad_b = g2.float().sum(0).to(ctx.bias_dtype) if needs_b else None
        ctx.w8_dgrad = ctx.wgrad_input = None
        if not needs_w:
            return grad_x, None, grad_b, None, None, None, None, None
        if ctx.plain_wgrad:  # FP8 compute only: param.grad in the weight's dtype, as nn.Linear
            return grad_x, grad_w.to(ctx.weight_dtype), grad_b, None, None, None, None, None
        return grad_x, None, grad_b, None, None, None, _weight_grad_to_fp8(layer, grad_w), None


def _weight_grad_to_fp8(layer: Fp8Linear, grad_w: torch.Tensor) -> torch.Tensor:
    """The float32 weight gradient cast to FP8 with fresh scales: the scales go to the
    layer's ``_grad_scale`` buffer (in place, so a compiled backward can write them), the
    data is returned as the gradient of the layer's ``_grad_sink``."""
    data, scale = layer.stored_weight.quantize_grad(grad_w)
    with torch.no_grad():
        layer._grad_scale.copy_(scale)
    return data


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would return for ``x``: autocast's where it is on."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
