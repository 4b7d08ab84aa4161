"""``Fp8Linear``: ``y = x W^T + b`` with all three GEMMs in FP8.

It also takes the place of a ``Conv1D``-like layer (GPT-2's ``transformers.pytorch_utils.Conv1D``:
``y = x W + b`` with the weight stored (in, out)): ``Fp8Linear.from_conv1d`` keeps that
Parameter in its own (K, N) orientation (``weight_transposed``), so the model's
``state_dict`` keys and shapes stay its own; the GEMMs take its transpose.

The layer reuses the caller's ``weight`` and ``bias`` Parameters. The weight's data is
stored as FP16 (O1, O2) or FP8 (O3) holding ``w * weight_scale``; ``weight_scale`` is a
buffer beside it. ``layer.stored_weight`` (an ``amp8.tensor.StoredWeight``) is the one place that
knows that storage. Backward returns the weight gradient to autograd as the weight's own
gradient, a ``WeightGrad`` (FP8 data + scales, the gradient of the real weight): it lands
in ``weight.grad``, where hooks, torch's ``zero_grad`` and ``clip_grad_norm_`` find it.
See DESIGN.md, "Weight gradients".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from amp8 import _compat
from amp8.config.levels import Precision
from amp8.config.recipe import Recipe
from amp8.config.validation import removed_name
from amp8.nn.conv1d import conv1d_parameters, with_parameters, without_parameters
from amp8.nn.function import _Fp8LinearFunction
from amp8.nn.gemm_config import LinearGemmConfig, output_dtype
from amp8.nn.gemm_layers import GemmKind, gemm_kind
from amp8.nn.gemm_precision import GemmPrecisionChoice
from amp8.nn.linear_checkpoint import prepare_linear_state
from amp8.nn.linear_weight import WeightUse, cast_weights, gemm_weight_shape, real_for_gemms, stored_for_gemms, weight_operands
from amp8.nn.quantizer import LinearQuantizers, TensorRole
from amp8.nn.single_weight import SingleStoredWeightModule
from amp8.quant.hadamard import random_hadamard
from amp8.quant.health import SIGNALS, GemmOperand, new_health
from amp8.tensor.scaled import ScaledTensor

REMOVED_METHODS = {
    "mark_weight_sharded": "renamed mark_weights_sharded(), as on Fp8Experts",
    "accumulate_weight_grad": "backward accumulates the FP8 weight gradient in weight.grad itself",
    "register_weight_grad_hook": "the FP8 weight gradient is the Parameter's own: use layer.weight.register_hook or "
    "layer.weight.register_post_accumulate_grad_hook",
    "encode_weight": "use amp8.tensor.stored_weight(layer.weight).encode(value)",
    "store_weight": "use layer.write_weight(value) for a real weight, or "
    "amp8.tensor.stored_weight(layer.weight).store(data, scale) for encoded storage",
    "weight_grad_nbytes": "use layer.weight.grad.nbytes (the FP8 data and its scales)",
}
"""``Fp8Linear``'s removed methods and what does the job of each now (mostly the weight's
``amp8.tensor.StoredWeight`` handle)."""


class Fp8Linear(GemmPrecisionChoice, SingleStoredWeightModule):
    """A linear layer whose forward, input-gradient and weight-gradient GEMMs run in FP8.

    Build one with ``Fp8Linear.from_linear(linear, recipe, weight_storage)`` (or
    ``from_conv1d`` for a ``Conv1D``-like layer); it takes over the layer's Parameter
    objects, so an optimizer that holds them still points at the right tensors.

    ``weight_transposed``: the weight Parameter holds ``W^T``, shape (in_features,
    out_features), as a ``Conv1D`` stores it; it stays so (storage, its gradient, its
    checkpoint entry), and the GEMMs take its transpose.

    Buffers (saved in ``state_dict``):
        weight_scale: float32, ``weight.data == w * weight_scale``: a scalar for FP16
            storage; for FP8 storage the weight's scales at the recipe's granularity
            (a scalar, (N, 1) per row, or (ceil(N / b), ceil(K / b)) per block).
        scale: (3,) float32, the FP8 scale last used for input, weight, grad_output
            (the smallest of a tensor's scales under fine-grained granularities).
        amax_history: (3, L) float32, newest first; L is 1 under current scaling.
        gemm_precision: (4,) int64, how the GEMMs run now (``set_gemm_precision``; see
            ``amp8.nn.gemm_precision``).
        hadamard: (16, 16) float32, the random Hadamard matrix of wgrad's operands, only
            under ``Recipe(wgrad_hadamard=True)``.

    A non-persistent ``health`` buffer (operands, signals) receives the health signals
    of the casts while ``watch_health`` is True (see ``amp8.quant.health``); ``gemm_moves``
    lists the changes ``amp8.Controller`` made to ``gemm_precision``.

    ``quantizers`` (a ``LinearQuantizers``) casts each tensor role to FP8 and writes
    those buffers in place; the autograd Function gets them, never the layer.

    amp8's own tensors keep their dtypes through ``model.to(dtype)``, ``.half()`` and
    ``.bfloat16()``: scales and histories stay float32 and the weight stays in its FP16 or
    FP8 storage (the bias follows the cast, as in any module).
    """

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as ``nn.Module`` finds them; a removed method
        (``REMOVED_METHODS``) fails naming what does its job now."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in REMOVED_METHODS:
                raise removed_name(type(self).__name__, name, REMOVED_METHODS) from None
            raise

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        recipe: Recipe,
        weight_storage: Precision = Precision.FP16,
        weight_transposed: bool = False,
    ) -> None:
        super().__init__()
        self.weight_transposed = weight_transposed
        rows, columns = weight.shape
        self.out_features, self.in_features = (columns, rows) if weight_transposed else (rows, columns)
        self._replaced: tuple[nn.Module, ...] = ()  # see ``from_conv1d``
        self.recipe = recipe
        device = weight.device
        self.register_buffer("scale", torch.ones(len(TensorRole), device=device))
        self.register_buffer("amax_history", torch.zeros(len(TensorRole), recipe.history_len, device=device))
        self.register_buffer("health", new_health(device), persistent=False)
        # The FP8 weight gradient's cast: not a GEMM operand, so apart from ``health``
        # (which amp8.Controller reads whole); the precision report reads it.
        self.register_buffer("grad_health", torch.zeros(SIGNALS, device=device), persistent=False)
        self._init_gemm_precision(recipe, device)
        self.watch_health = False
        self.compiled_casts = False  # see ``set_compiled_casts``
        if recipe.wgrad_hadamard:
            self.register_buffer("hadamard", random_hadamard().to(device))
        self._bind_quantizers()
        # FP8 copies of an FP16 weight, by the dim their GEMM contracts; see ``fp8_weight``.
        self._weight_cache: dict[int, ScaledTensor] = {}
        self._weight_cache_version: tuple[int, ...] | None = None  # the stored weight's, when cached
        self._init_storage(weight, recipe, weight_storage)
        self.bias = bias

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, weight_storage: Precision = Precision.FP16
    ) -> "Fp8Linear":
        """Swap-in for ``linear`` that reuses its Parameters (their data is re-stored)."""
        layer = cls(linear.weight, linear.bias, recipe, weight_storage)
        layer.train(linear.training)
        return layer

    @classmethod
    def from_module(
        cls, module: nn.Module, recipe: Recipe, weight_storage: Precision = Precision.FP16
    ) -> "Fp8Linear":
        """Swap-in for a GEMM layer of either kind ``amp8.nn.gemm_layers.gemm_kind``
        knows: ``from_linear`` for an ``nn.Linear`` (or subclass), ``from_conv1d`` for a
        ``Conv1D``-like layer. Whether its forward computes that math is the swap's
        check (``amp8.nn.gemm_layers.math_reason``).

        Raises:
            TypeError: ``module`` is neither.
        """
        kind = gemm_kind(module)
        if kind is GemmKind.LINEAR:
            return cls.from_linear(module, recipe, weight_storage)  # type: ignore[arg-type]
        if kind is GemmKind.TRANSPOSED:
            return cls.from_conv1d(module, recipe, weight_storage)
        raise TypeError(
            f"Fp8Linear.from_module takes an nn.Linear or a Conv1D-like module (amp8.nn.gemm_layers), "
            f"got {type(module).__name__}"
        )

    @classmethod
    def from_conv1d(
        cls, conv1d: nn.Module, recipe: Recipe, weight_storage: Precision = Precision.FP16
    ) -> "Fp8Linear":
        """Swap-in for a ``Conv1D``-like layer (``y = x W + b``, ``weight`` of shape
        (in, out); see ``amp8.nn.gemm_layers``) that reuses its Parameters in their own
        shapes (``weight_transposed``). ``replaced_module`` gives the replaced module back.

        Raises:
            TypeError: ``conv1d`` has no 2-D ``weight`` Parameter with a bias of its
                second dim (or none).
        """
        weight, bias = conv1d_parameters(conv1d)
        layer = cls(weight, bias, recipe, weight_storage, weight_transposed=True)
        layer._replaced = (without_parameters(conv1d),)  # ``replaced_module`` gives it back
        layer.train(conv1d.training)
        return layer

    def replaced_module(self, real_weight: torch.Tensor) -> nn.Module:
        """The ``Conv1D``-like module ``from_conv1d`` replaced (a new copy), holding
        ``real_weight`` (float, (in, out)) and a copy of this layer's bias: a plain
        module computing this layer's math (``amp8.export``).

        Raises:
            TypeError: this layer was not built by ``from_conv1d``.
        """
        if not self._replaced:
            raise TypeError(
                "Fp8Linear.replaced_module gives back the Conv1D-like module of a layer built by "
                "Fp8Linear.from_conv1d; for one built from an nn.Linear, build an nn.Linear"
            )
        return with_parameters(self._replaced[0], real_weight, self.weight.requires_grad, self.bias, self.training)

    def narrow_weight(self, dim: int, start: int, length: int) -> None:
        """Keep a slice of the weight (``SingleStoredWeightModule.narrow_weight``: one
        rank's shard under tensor parallelism), of an (out, in) weight only.

        Raises:
            ValueError: the weight Parameter holds ``W^T`` (``from_conv1d``).
        """
        if self.weight_transposed:
            raise ValueError(
                "this Fp8Linear holds a Conv1D's (in, out) weight (weight_transposed): amp8's tensor-parallel "
                "styles shard (out, in) weights; keep this layer out of the tensor-parallel plan, or convert "
                "the model's Conv1D layers to nn.Linear before amp8.initialize"
            )
        super().narrow_weight(dim, start, length)

    def _bind_quantizers(self) -> None:
        """(Re)build ``quantizers`` over the current ``scale``, ``amax_history`` and
        ``health`` buffers (``.to()`` and ``load_state_dict(assign=True)`` may replace
        them), for the GEMMs as ``gemm_recipe`` says; ``gemm_precision`` is rewritten
        from it."""
        self._record_gemm_precision()
        self.quantizers = LinearQuantizers.build(
            self.gemm_recipe, self.scale, self.amax_history, self.health,
            rotation=getattr(self, "hadamard", None), compiled=self.compiled_casts,
        )

    def set_compiled_casts(self, compiled: bool) -> None:
        """Run the layer's casts outside ``torch.compile`` (the input, weight, output
        gradient and weight gradient) as amp8's compiled kernels (True) or as eager
        operations (False, the default); see ``amp8.nn.cast_kernels``. The bits are the
        same."""
        self.compiled_casts = compiled
        self._bind_quantizers()

    def _gemms_changed(self) -> None:
        """After ``set_gemm_precision``: the casts for the GEMMs as they run now."""
        self.drop_weight_cache()
        self._bind_quantizers()

    def _after_move(self) -> None:
        self._bind_quantizers()

    def weight_tile(self, contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile of the weight's FP8 scales for a GEMM contracting its dim
        ``contract_dim`` (1: the forward GEMM, 0: the input-gradient GEMM)."""
        return self.quantizers.weight.rule.tile(gemm_weight_shape(self.weight, self.weight_transposed), contract_dim)

    def gemm_weight(self) -> torch.Tensor:
        """The weight's real values in float32 as the GEMMs take them, (N, K): the
        transpose of ``read_weight()`` where the Parameter holds ``W^T``."""
        return real_for_gemms(self.stored_weight, self.weight_transposed)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (another opt level, another
        recipe, or a plain ``nn.Linear``) and filling scale buffers such a checkpoint
        lacks (see ``amp8.nn.linear_checkpoint``). The GEMM precision of a checkpoint made
        under another recipe (see ``amp8.nn.state_dict_form.recipe_record``) is not taken:
        the GEMMs run as this layer's recipe says."""
        # The GEMMs run as saved from here on (``_after_move`` binds them).
        self.gemm_recipe = prepare_linear_state(
            state_dict, prefix, args[0] if args else None, recipe=self.recipe, gemm_recipe=self.gemm_recipe,
            scale=self.scale, amax_history=self.amax_history, gemm_precision=self.gemm_precision,
            hadamard=self.hadamard if self.recipe.wgrad_hadamard else None,
        )
        super()._load_from_state_dict(state_dict, prefix, *args)

    # -- FP8 casts (see ``quantizers``) ------------------------------------------------
    def fp8_dtype(self, role: TensorRole) -> torch.dtype:
        """The FP8 dtype the tensor in ``role`` is cast to for a GEMM."""
        return self.quantizers.of(role).rule.dtype

    def tile(self, role: TensorRole, shape: tuple[int, ...], contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile sharing one scale when a tensor of ``shape`` in ``role`` is cast for a
        GEMM contracting its dim ``contract_dim``; None for one scale per tensor."""
        return self.quantizers.of(role).rule.tile(shape, contract_dim)

    def next_scale(
        self, role: TensorRole, x: torch.Tensor, contract_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, amax)`` the next cast of ``x`` in ``role`` would use; changes nothing
        (see ``Quantizer.next_scale``)."""
        return self.quantizers.of(role).next_scale(x, contract_dim)

    def cast(
        self, role: TensorRole, x: torch.Tensor, contract_dim: int = 1, *, record: bool = True
    ) -> ScaledTensor:
        """Cast the 2-D ``x`` to FP8 for ``role`` and a GEMM contracting its dim
        ``contract_dim``. With ``record``, the scale (the smallest, under fine-grained
        granularities) goes to the ``scale`` buffer and, in training, the amax to the
        history; the re-casts for the transposed backward GEMMs do not record."""
        return self.quantizers.of(role).cast(x, contract_dim, record=record, update_history=self.training)

    def fp8_weight(self, contract_dim: int = 1) -> ScaledTensor:
        """The (N, K) weight as the FP8 GEMMs get it, with scales for a GEMM contracting
        its dim ``contract_dim``: the stored FP8 weight at O3 where its scales fit, else a
        cast (from the FP8 weight's real values at O3: rowwise scales along the other
        dim, for the input-gradient GEMM). A cast for ``contract_dim`` 0 serves that GEMM
        alone and holds its data column-major, as the GEMM reads it.

        The cast of an FP16 weight is cached until the weight is next written, by any
        path (the stored weight's ``version``, read in eager code; the optimizer's step,
        ``load_state_dict`` and ``.to()`` also drop the cache for compiled code), so the
        micro-batches of gradient accumulation cast it once per optimizer step.
        """
        return self.fp8_weights((contract_dim,))[0]

    def fp8_weights(self, contract_dims: tuple[int, ...], replay: bool = False) -> tuple[ScaledTensor, ...]:
        """``fp8_weight`` for each of ``contract_dims``, the casts made together (one call
        of compiled kernels where the casts are compiled); with ``replay``, casts that
        repeat a forward's (``amp8.nn.cast_kernels.CastSpec.replay``)."""
        if not torch.compiler.is_compiling():
            version = self.stored_weight.version
            if version != getattr(self, "_weight_cache_version", None):
                self._weight_cache.clear()
                self._weight_cache_version = version
        uses = tuple(
            WeightUse(dim, self.weight_tile(dim), self._weight_operands(dim) if self.watch_health else ())
            for dim in contract_dims
        )
        return cast_weights(self.quantizers.weight, self.stored_weight, self.weight_transposed, self._weight_cache,
                            uses, training=self.training, replay=replay)

    def _weight_operands(self, contract_dim: int) -> tuple[GemmOperand, ...]:
        """The GEMM operands a cast of the weight for ``contract_dim`` serves."""
        return weight_operands(contract_dim, self.weight_tile(0) == self.weight_tile(1))

    def drop_weight_cache(self) -> None:
        """Forget the cached FP8 casts of the weight (see ``fp8_weight``)."""
        self._weight_cache.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` of shape (..., in_features)."""
        if self.stored_weight.sharded and not _compat.COMPILED_SHARDED_LAYERS.available():
            return self._forward_outside_graphs(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8Linear expects inputs of shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        if not torch.compiler.is_compiling():
            plain = self._plain_weight()
            if plain is not None:  # functional_call: torch's linear, in the given tensor's dtype
                return F.linear(x, plain.t() if self.weight_transposed else plain, self.bias)
            self._refresh_grad_routes()
        fp8_wgrad = self.weight_storage is not Precision.AS_IS
        # Activation checkpointing runs the forward again in backward: its casts repeat
        # the first forward's (the same scales, so the same FP8 data) and record nothing.
        replay = _compat.running_backward()
        config = LinearGemmConfig.build(
            self.gemm_recipe, self.in_features, self.out_features,
            fp8_wgrad=fp8_wgrad, update_history=self.training, out_dtype=output_dtype(x),
            watch_health=self.watch_health, grad_layout=self.stored_weight.grad_layout if fp8_wgrad else None,
            weight_transposed=self.weight_transposed, replay=replay,
        )
        # The weight's FP8 casts happen here, outside the autograd.Function, so that the
        # cache (a module attribute) is written where a compiled graph may write it.
        w8 = w8_dgrad = None  # (N, K)
        needs_dgrad = torch.is_grad_enabled() and x.requires_grad and not config.high_dgrad
        if needs_dgrad and self.weight_tile(0) != self.weight_tile(1):  # rowwise: scales per column for dgrad
            w8, w8_dgrad = self.fp8_weights((1, 0), replay)
        elif not (config.high_fprop and config.high_dgrad):
            w8 = w8_dgrad = self.fp8_weights((1,), replay)[0]
        w_stored = None
        if config.high_fprop or config.high_dgrad:
            w_stored = stored_for_gemms(self.stored_weight, self.weight_transposed)[0]
        if self.watch_health:  # a GEMM in high precision: watch the cast it would get
            for contract_dim, high in ((1, config.high_fprop), (0, config.high_dgrad)):
                if high:
                    self.quantizers.weight.watch(w_stored.dequantize(), contract_dim, self._weight_operands(contract_dim))  # type: ignore[union-attr]
        with torch.autocast(x.device.type, enabled=False):  # the GEMMs choose their own dtypes
            slot = self.stored_weight.backward_slot()
            return _Fp8LinearFunction.apply(
                x, self._grad_target(), self.bias, w8, w8_dgrad, w_stored, self.quantizers, config, self.grad_health,
                slot,
            )

    # A torch without COMPILED_SHARDED_LAYERS cannot trace a sharded layer: run it eagerly.
    _forward_outside_graphs = torch.compiler.disable(_forward)

    def extra_repr(self) -> str:
        """Shape, weight storage and recipe, for ``print(model)``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.weight_dtype}, "
            + ("weight_transposed=True (in, out), " if self.weight_transposed else "")
            + f"format={self.recipe.fp8_format.value}, scaling={self.recipe.scaling.value}, "
            f"granularity={self.gemm_granularity.value}"
            + (f", gemms={self.gemm_description!r}" if self.high_precision_gemms != (False,) * 3 else "")
        )

