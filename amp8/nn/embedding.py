"""``LowBitEmbedding``: an embedding table stored at an opt level's bytes.

The lookup is a gather, not a GEMM, so nothing here computes in FP8. What the level
changes is storage: the table is kept in FP16 with one power-of-two scale (2 bytes per
element, rounded stochastically by the optimizer, as FP8 layers' FP16 weights are), and
its gradient in FP8 with one scale per row (1 byte per element: a row is one token's
gradient, and the rows of rare and frequent tokens differ by orders of magnitude). The
table keeps FP16 at O3 too: forward reads a few rows of it, so an FP8 copy beside FP16
master weights would cost more bytes than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe, WeightGradScaling
from amp8.nn.single_weight import SingleStoredWeightModule
from amp8.nn.swap import embedding_reason
from amp8.tensor.scaled import ScaledTensor
from amp8.tensor.weight_grad import GradLayout, GradSlot, WeightGrad, WeightGradInFlight


@dataclass(frozen=True)
class EmbeddingConfig:
    """What one call of ``_EmbeddingFunction`` needs besides its tensors.

    Attributes:
        num_embeddings: rows of the table.
        embedding_dim: columns of the table.
        padding_idx: the row that gets no gradient, or None.
        grad_layout: how the FP8 weight gradient is stored (one scale per row).
        out_dtype: the dtype of the looked-up rows (the table's dtype before amp8).
    """

    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None
    grad_layout: GradLayout
    out_dtype: torch.dtype


class _EmbeddingFunction(torch.autograd.Function):
    """Rows of a scaled table, and the table's gradient in FP8 with one scale per row.

    Arguments of ``apply``: ``ids`` (integer indices); ``weight``, the tensor that takes
    the weight gradient (the Parameter, or a stand-in: see
    ``SingleStoredWeightModule._grad_target``; None when none is needed); ``table`` (the
    stored table with its scale); the ``EmbeddingConfig``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor | None,
        table: ScaledTensor,
        config: EmbeddingConfig,
        grad_slot: GradSlot | None = None,
    ) -> torch.Tensor:
        rows = nn.functional.embedding(ids, table.data)
        ctx.save_for_backward(ids)
        ctx.config = config
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.grad_class = WeightGradInFlight if isinstance(weight, WeightGradInFlight) else WeightGrad
        ctx.grad_slot = grad_slot
        real = rows.float() / table.scale
        # A cast to the dtype a tensor has returns that tensor, and torch 2.11's Dynamo
        # loses the gradient of a Function whose output is such a cast: cast only if needed.
        return real if real.dtype == config.out_dtype else real.to(config.out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        unused = (None, None, None)  # table, config, grad_slot
        if not ctx.needs_input_grad[1]:
            return (None, None, *unused)
        (ids,) = ctx.saved_tensors
        config: EmbeddingConfig = ctx.config
        grad = torch.zeros(config.num_embeddings, config.embedding_dim, device=grad_output.device)
        grad.index_add_(0, ids.reshape(-1), grad_output.reshape(-1, config.embedding_dim).float())
        if config.padding_idx is not None:
            grad[config.padding_idx] = 0
        grad_w = ctx.grad_class.from_float(grad, config.grad_layout, ctx.weight_dtype, slot=ctx.grad_slot)
        return (None, grad_w, *unused)


class LowBitEmbedding(SingleStoredWeightModule):
    """``nn.Embedding`` with its table in FP16 (one scale) and its gradient in FP8 (one
    scale per row), for opt levels that store weights in low precision.

    Build one with ``LowBitEmbedding.from_embedding(embedding, recipe)``; it takes over
    the ``nn.Embedding``'s Parameter, so an optimizer that holds it still points at the
    right tensor. ``recipe.weight_grad_dtype`` is the gradient's FP8 format.
    """

    def __init__(self, weight: nn.Parameter, recipe: Recipe, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.out_dtype = weight.dtype
        self.recipe = recipe.replace(weight_grad_scaling=WeightGradScaling.ROWWISE)
        self._init_storage(weight, self.recipe, Precision.FP16, fixed_storage=True)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, recipe: Recipe) -> "LowBitEmbedding":
        """Swap-in for ``embedding`` that reuses its Parameter (its data is re-stored).

        Raises:
            ValueError: an embedding whose options need its full-precision table or a
                sparse gradient (see ``amp8.nn.swap.embedding_reason``).
        """
        reason = embedding_reason(embedding, {})
        if reason is not None:
            raise ValueError(f"amp8 cannot store this nn.Embedding in low precision: {reason}")
        layer = cls(embedding.weight, recipe, embedding.padding_idx)
        layer.train(embedding.training)
        return layer

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "LowBitEmbedding":
        """``.to()``, ``.half()`` and friends: the table keeps its FP16 storage, and the
        looked-up rows follow the cast, as an ``nn.Embedding``'s would."""
        probe = fn(torch.zeros((), dtype=self.out_dtype))
        if probe.is_floating_point():
            self.out_dtype = probe.dtype
        return super()._apply(fn, recurse)  # type: ignore[return-value]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the table at ``ids`` (any integer shape), in the table's dtype."""
        if not torch.compiler.is_compiling():
            plain = self._plain_weight()
            if plain is not None:  # functional_call: torch's embedding, in the given tensor's dtype
                return F.embedding(ids, plain, self.padding_idx)
            self._refresh_grad_routes()
        config = EmbeddingConfig(
            self.num_embeddings, self.embedding_dim, self.padding_idx, self.stored_weight.grad_layout, self.out_dtype,
        )
        slot = self.stored_weight.backward_slot()
        return _EmbeddingFunction.apply(ids, self._grad_target(), self.stored_weight.stored(), config, slot)

    def extra_repr(self) -> str:
        """Shape and storage, for ``print(model)``."""
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{padding}, weight={self.weight_dtype}, "
            f"grad={self.stored_weight.grad_dtype}"
        )
