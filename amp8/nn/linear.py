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

import copy
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from amp8 import _compat
from amp8.config.levels import Precision
from amp8.config.recipe import GRANULARITY_LADDER, Granularity, Recipe
from amp8.config.validation import removed_name
from amp8.nn.gemm_layers import GemmKind, gemm_kind
from amp8.nn.function import LinearGemmConfig, _Fp8LinearFunction, output_dtype
from amp8.nn.quantizer import LinearQuantizers, TensorRole
from amp8.nn.stored_module import StoredWeightModule, recipe_record, saved_recipe
from amp8.quant.checks import check_loaded_history, check_loaded_scales
from amp8.quant.hadamard import random_hadamard
from amp8.quant.health import SIGNALS, Gemm, GemmOperand, new_health
from amp8.tensor.scaled import ScaledTensor

OUTLIER_SPLIT = 2
"""wgrad's entry in ``gemm_precision`` where only its outlier tokens run in high precision."""


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


class Fp8Linear(StoredWeightModule):
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
        gemm_precision: (4,) int64, how the GEMMs run now: the index of their
            granularity in ``GRANULARITY_LADDER``, then 1 for each of fprop, dgrad and
            wgrad that runs in high precision (``set_gemm_precision``); wgrad's entry is
            ``OUTLIER_SPLIT`` (2) where only its outlier tokens do.
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
        self.register_buffer("gemm_precision", torch.zeros(4, dtype=torch.int64, device=device))
        self.watch_health = False
        self.compiled_casts = False  # see ``set_compiled_casts``
        self.gemm_moves: list[Any] = []  # the ``amp8.monitor.controller.Move``s of this layer
        self.gemm_recipe = recipe
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
        weight, bias = getattr(conv1d, "weight", None), getattr(conv1d, "bias", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or (
            bias is not None and tuple(bias.shape) != (weight.shape[1],)
        ):
            raise TypeError(
                f"Fp8Linear.from_conv1d takes a Conv1D-like module (a 2-D weight Parameter of shape "
                f"(in, out) and a bias of shape (out,) or None), got {type(conv1d).__name__}; use "
                "Fp8Linear.from_linear for an nn.Linear"
            )
        layer = cls(weight, bias, recipe, weight_storage, weight_transposed=True)
        # A copy without its Parameters, outside the module tree (not in state_dict, and
        # holding no weight that sharding replaces): ``replaced_module`` gives it back.
        layer._replaced = (copy.deepcopy(conv1d, {id(p): None for p in conv1d.parameters(recurse=False)}),)
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
        plain = copy.deepcopy(self._replaced[0])
        plain.weight = nn.Parameter(real_weight.detach().clone(), requires_grad=self.weight.requires_grad)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=self.bias.requires_grad)
        plain.train(self.training)
        return plain

    def narrow_weight(self, dim: int, start: int, length: int) -> None:
        """Keep a slice of the weight (``StoredWeightModule.narrow_weight``: one rank's
        shard under tensor parallelism), of an (out, in) weight only.

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
        from it (``to_empty`` leaves buffers uninitialized)."""
        high = [int(flag) for flag in self.gemm_recipe.override_linear_precision]
        if self.splits_wgrad_outliers:
            high[-1] = OUTLIER_SPLIT
        with torch.no_grad():
            self.gemm_precision.copy_(torch.tensor([GRANULARITY_LADDER.index(self.gemm_recipe.granularity), *high]))
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

    def set_gemm_precision(
        self, granularity: Granularity | str, high_precision: tuple[bool, bool, bool], outlier_split: bool = False
    ) -> None:
        """Run the GEMMs from now on at ``granularity``, with each of (fprop, dgrad,
        wgrad) in high precision where ``high_precision`` says True, and wgrad's outlier
        tokens in high precision where ``outlier_split`` (``Recipe.wgrad_outlier_split``).
        The weight, its gradient and their scales stay as the recipe stores them; only
        the casts that feed the GEMMs change. ``amp8.Controller`` calls this; it is kept
        in ``state_dict`` (``gemm_precision``)."""
        self.gemm_recipe = self.recipe.for_gemms(Granularity(granularity), tuple(high_precision), outlier_split)
        self.drop_weight_cache()
        self._bind_quantizers()

    @property
    def gemm_granularity(self) -> Granularity:
        """The granularity of the GEMMs' FP8 scales now (see ``set_gemm_precision``)."""
        return self.gemm_recipe.granularity

    @property
    def high_precision_gemms(self) -> tuple[bool, bool, bool]:
        """Which of (fprop, dgrad, wgrad) run in high precision now."""
        return self.gemm_recipe.override_linear_precision  # type: ignore[return-value]

    @property
    def splits_wgrad_outliers(self) -> bool:
        """Whether wgrad's outlier tokens run in high precision and the rest in FP8 now
        (not where the whole of wgrad is high)."""
        return self.gemm_recipe.wgrad_outlier_split and not self.high_precision_gemms[-1]

    @property
    def gemm_description(self) -> str:
        """The GEMMs' precision in words: the granularity of their FP8 scales, then the
        GEMMs in high precision, e.g. "block, wgrad high" or "block, wgrad outliers
        high"."""
        high = [gemm.name.lower() for gemm, flag in zip(Gemm, self.high_precision_gemms) if flag]
        if self.splits_wgrad_outliers:
            high.append("wgrad outliers")
        text = self.gemm_granularity.value
        return f"{text}, {'+'.join(high)} high" if high else text

    def _after_move(self) -> None:
        self._bind_quantizers()

    def weight_tile(self, contract_dim: int = 1) -> tuple[int, int] | None:
        """The tile of the weight's FP8 scales for a GEMM contracting its dim
        ``contract_dim`` (1: the forward GEMM, 0: the input-gradient GEMM)."""
        return self.quantizers.weight.rule.tile(self._gemm_weight_shape(), contract_dim)

    def _gemm_weight_shape(self) -> tuple[int, int]:
        """The (N, K) shape of the weight as the GEMMs take it."""
        rows, columns = self.weight.shape
        return (columns, rows) if self.weight_transposed else (rows, columns)

    def gemm_weight(self) -> torch.Tensor:
        """The weight's real values in float32 as the GEMMs take them, (N, K): the
        transpose of ``read_weight()`` where the Parameter holds ``W^T``."""
        real = self.read_weight()
        return real.t().contiguous() if self.weight_transposed else real

    def _stored_for_gemms(self) -> tuple[ScaledTensor, tuple[int, int] | None]:
        """The stored weight as the GEMMs take it, (N, K), and the tile of its scales
        for the forward GEMM: where the Parameter holds ``W^T``, its transpose with the
        scales transposed alongside (exact: the same values and scales)."""
        stored, tile = self.stored_weight.stored(), self.stored_weight.tile()
        if not self.weight_transposed:
            return stored, tile
        return stored.t(), None if tile is None else (tile[1], tile[0])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load, converting a weight saved at another storage (another opt level, another
        recipe, or a plain ``nn.Linear``) and filling scale buffers such a checkpoint
        lacks. The GEMM precision of a checkpoint made under another recipe (see
        ``recipe_record``) is not taken: the GEMMs run as this layer's recipe says."""
        if state_dict.get(prefix + "scale") is not None:
            check_loaded_scales(prefix + "scale", state_dict[prefix + "scale"])
        if state_dict.get(prefix + "amax_history") is not None:
            check_loaded_history(prefix + "amax_history", state_dict[prefix + "amax_history"])
        key = prefix + "gemm_precision"
        saved_precision = state_dict.get(key)
        if saved_precision is not None:  # the GEMMs run as saved from here on (``_after_move`` binds them)
            loaded = _loaded_gemm_recipe(self.recipe, key, saved_precision, saved_recipe(args[0] if args else None))
            self.gemm_recipe = self.recipe if loaded is None else loaded
        # Rewritten from ``gemm_recipe`` once loaded; a checkpoint from before the GEMMs
        # could move lacks it.
        state_dict[key] = self.gemm_precision.clone()
        if self.recipe.wgrad_hadamard:  # a checkpoint of another recipe lacks it: keep this one's
            state_dict.setdefault(prefix + "hadamard", self.hadamard.clone())
        else:
            state_dict.pop(prefix + "hadamard", None)
        for key, buffer in ((prefix + "scale", self.scale), (prefix + "amax_history", self.amax_history)):
            saved_buffer = state_dict.get(key)
            if saved_buffer is None:
                state_dict[key] = buffer.clone()
            elif saved_buffer.shape != buffer.shape:  # another amax_history_len
                resized = torch.zeros_like(buffer)
                length = min(saved_buffer.shape[-1], buffer.shape[-1])
                resized[..., :length] = saved_buffer[..., :length]
                state_dict[key] = resized
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
        dim, for the input-gradient GEMM).

        The cast of an FP16 weight is cached until the weight is next written, by any
        path (the stored weight's ``version``, read in eager code; the optimizer's step,
        ``load_state_dict`` and ``.to()`` also drop the cache for compiled code), so the
        micro-batches of gradient accumulation cast it once per optimizer step.
        """
        if not torch.compiler.is_compiling():
            version = self.stored_weight.version
            if version != getattr(self, "_weight_cache_version", None):
                self._weight_cache.clear()
                self._weight_cache_version = version
        weight = self.quantizers.weight
        watch = self._weight_operands(contract_dim) if self.watch_health else ()
        if self.weight_storage is Precision.AS_IS:  # the user's optimizer writes it: no cache
            return weight.cast(
                self.gemm_weight(), contract_dim, record=contract_dim == 1, update_history=self.training, watch=watch
            )
        if self.weight_storage is Precision.FP8:
            stored, stored_tile = self._stored_for_gemms()
            # Microscaled GEMMs take their own format: re-cast from the stored real values.
            if self.weight_tile(contract_dim) != stored_tile or weight.rule.microscaled:
                return weight.cast(stored.dequantize().contiguous(), contract_dim, watch=watch)
            if not self.weight_transposed:
                return stored  # the optimizer cast it: nothing to watch here
            # W^T's bytes laid out as (N, K), once until the weight is next written.
            cached = self._weight_cache.get(contract_dim)
            if cached is None:
                cached = self._weight_cache[contract_dim] = stored.with_data(stored.data.contiguous())
            return cached
        cached = self._weight_cache.get(contract_dim)
        if cached is None:
            cached = weight.cast(
                self.gemm_weight(), contract_dim, record=contract_dim == 1, update_history=self.training, watch=watch
            )
            self._weight_cache[contract_dim] = cached
        return cached

    def _weight_operands(self, contract_dim: int) -> tuple[GemmOperand, ...]:
        """The GEMM operands a cast of the weight for ``contract_dim`` serves."""
        if contract_dim == 0:
            return (GemmOperand.DGRAD_WEIGHT,)
        if self.weight_tile(0) == self.weight_tile(1):
            return (GemmOperand.FPROP_WEIGHT, GemmOperand.DGRAD_WEIGHT)
        return (GemmOperand.FPROP_WEIGHT,)

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
        config = LinearGemmConfig.build(
            self.gemm_recipe, self.in_features, self.out_features,
            fp8_wgrad=fp8_wgrad, update_history=self.training, out_dtype=output_dtype(x),
            watch_health=self.watch_health, grad_layout=self.stored_weight.grad_layout if fp8_wgrad else None,
            weight_transposed=self.weight_transposed,
        )
        # The weight's FP8 casts happen here, outside the autograd.Function, so that the
        # cache (a module attribute) is written where a compiled graph may write it.
        w8 = self.fp8_weight() if not (config.high_fprop and config.high_dgrad) else None  # (N, K)
        w8_dgrad = w8
        needs_dgrad = torch.is_grad_enabled() and x.requires_grad and not config.high_dgrad
        if needs_dgrad and self.weight_tile(0) != self.weight_tile(1):
            w8_dgrad = self.fp8_weight(contract_dim=0)  # rowwise: scales per column
        w_stored = self._stored_for_gemms()[0] if config.high_fprop or config.high_dgrad else None
        if self.watch_health:  # a GEMM in high precision: watch the cast it would get
            for contract_dim, high in ((1, config.high_fprop), (0, config.high_dgrad)):
                if high:
                    self.quantizers.weight.watch(w_stored.dequantize(), contract_dim, self._weight_operands(contract_dim))  # type: ignore[union-attr]
        with torch.autocast(x.device.type, enabled=False):  # the GEMMs choose their own dtypes
            slot = None if torch.compiler.is_compiling() else self.stored_weight.grad_slot
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


def _loaded_gemm_recipe(
    recipe: Recipe, key: str, saved: torch.Tensor, saved_under: dict[str, Any] | None
) -> Recipe | None:
    """The GEMM recipe a checkpoint's ``gemm_precision`` tensor describes for a layer of
    ``recipe``; None, with a warning, where it was made under another recipe
    (``saved_under``, the checkpoint's ``recipe_record``) or one that ``recipe`` cannot
    take (a checkpoint without a record).

    Raises:
        ValueError: ``saved`` is not four integers (a granularity index, then three 0/1
            flags, wgrad's also ``OUTLIER_SPLIT``); the message names ``key``.
    """
    values = saved.tolist() if saved.shape == (4,) and not saved.is_floating_point() else None
    if values is None or not 0 <= values[0] < len(GRANULARITY_LADDER) or any(
        v not in (0, 1) for v in values[1:3]
    ) or values[3] not in (0, 1, OUTLIER_SPLIT):
        raise ValueError(
            f"checkpoint entry {key} = {saved.tolist()} is not a GEMM precision: expected four integers, a "
            f"granularity index below {len(GRANULARITY_LADDER)}, two 0/1 flags and a wgrad entry of 0, 1 or "
            f"{OUTLIER_SPLIT}; the checkpoint is corrupt or not from amp8"
        )
    granularity = GRANULARITY_LADDER[values[0]]
    high, split = (bool(values[1]), bool(values[2]), values[3] == 1), values[3] == OUTLIER_SPLIT
    reason = None
    if saved_under is not None and saved_under != recipe_record(recipe):
        reason = f"it was made under another recipe ({saved_under})"
    else:
        try:
            return recipe.for_gemms(granularity, high, split)
        except ValueError as error:
            reason = f"this layer's recipe cannot take it ({error})"
    warnings.warn(
        f"amp8: {key} ({granularity.value} GEMMs, high precision {high}) is not loaded: {reason}; the "
        f"GEMMs run as this layer's recipe says ({recipe_record(recipe)})",
        stacklevel=4,
    )
    return None
