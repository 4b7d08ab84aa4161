"""``Fp8Experts``: a mixture-of-experts layer's experts with their GEMMs in FP8.

It takes the place of an experts module (see ``amp8.nn.experts_layout``) and reuses its
two Parameters, under their own names, so the optimizer, ``state_dict`` keys and
checkpoints see the same tensors as before. Its forward is the one transformers' grouped
experts implementation computes: each token's hidden state goes to its top-k experts,
each expert computes ``down(act(gate(x)) * up(x))`` on its tokens, and the results are
summed with the routing weights, which the router outside computed in high precision.
The tokens are sorted by expert into padded groups (``amp8.ops.grouped_gemm.ExpertGroups``),
and both projections run their forward, input-gradient and weight-gradient GEMMs in FP8
through ``_Fp8ExpertsFunction``. The Parameters are stored as an ``Fp8Linear``'s weight
is at the opt level (``amp8.tensor.StoredWeight``, scales per expert): FP16 with one scale
at O1 and O2, FP8 beside the optimizer's FP16 master at O3, and their gradients are FP8
``WeightGrad`` s with each expert's own scales; at "O1-compute" they stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from amp8.config.levels import Precision
from amp8.config.recipe import Recipe, Scaling
from amp8.nn.experts_function import _Fp8ExpertsFunction
from amp8.nn.experts_layout import ExpertsLayout, experts_layout, experts_reason
from amp8.nn.gemm_config import LinearGemmConfig, output_dtype
from amp8.nn.grad_routes import grad_sink
from amp8.nn.quantizer import CastRule, LinearQuantizers, Quantizer, TensorRole
from amp8.nn.stored_weights import StoredWeightsBase
from amp8.ops.grouped_gemm import ExpertGroups
from amp8.quant.hadamard import random_hadamard
from amp8.tensor.stored import StoredWeight


@dataclass(frozen=True)
class Routing:
    """Where each routed token goes in the padded token matrix sorted by expert.

    Attributes:
        groups: the experts' token groups.
        source: (``groups.rows``,) the token each row copies; the token count (one past
            the last token: a zero row) for padding rows.
        rows: (tokens * k,) the row of each (token, slot) pair, in ``top_k_index``'s
            order; ``groups.rows`` (past the last row: a zero row) for a pair routed to
            no expert (an index outside [0, E), as expert parallelism marks them).
    """

    groups: ExpertGroups
    source: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def from_indices(cls, top_k_index: torch.Tensor, num_experts: int) -> "Routing":
        """The routing of the (tokens, k) expert indices ``top_k_index`` over
        ``num_experts`` experts (the token counts are read once, on the host)."""
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1).long()
        experts = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
        sorted_experts, order = torch.sort(experts, stable=True)
        counts = torch.bincount(sorted_experts, minlength=num_experts + 1)
        groups = ExpertGroups.from_counts(counts[:num_experts])
        first = torch.cumsum(counts, 0) - counts  # each expert's first pair in sorted order
        padded = torch.tensor([*groups.starts, groups.rows], device=experts.device)
        position = torch.arange(experts.numel(), device=experts.device) - first[sorted_experts]  # within the group
        destination = padded[sorted_experts] + position
        destination = torch.where(sorted_experts < num_experts, destination, groups.rows)
        rows = torch.empty_like(destination).scatter_(0, order, destination)
        source = torch.full((groups.rows + 1,), tokens, dtype=torch.long, device=experts.device)
        source = source.scatter(0, destination, order // k)[: groups.rows]
        return cls(groups, source, rows)


class Fp8Experts(StoredWeightsBase):
    """A mixture-of-experts layer's experts whose GEMMs run in FP8, grouped per expert.

    Build one with ``Fp8Experts.from_module(experts, recipe, weight_storage)``;
    ``to_module()`` gives the module it replaced back, holding this module's weights
    (``amp8.export`` uses it). ``forward(hidden_states, top_k_index, top_k_weights)`` takes what the experts
    module took: (tokens, H) hidden states, the (tokens, k) experts each token goes to
    and their (tokens, k) routing weights; it returns (tokens, H) in the hidden states'
    dtype.

    Every GEMM of both projections runs in FP8 under ``recipe`` as an ``Fp8Linear``'s
    would, expert by expert on its tokens, except that the casts take current scales
    (delayed scaling keeps one amax history per tensor), record nothing and are not
    watched (``amp8.Controller`` does not move the experts' GEMMs).

    ``weight_storage`` stores both Parameters as ``StoredWeight`` s do an ``Fp8Linear``'s
    weight (``Precision.FP16`` or ``FP8``, with ``{name}_scale`` buffers and scales per
    expert matrix), their gradients as FP8 ``WeightGrad`` s with each expert's own scales;
    ``Precision.AS_IS`` leaves both as they are.
    """

    def __init__(
        self, experts: nn.Module, layout: ExpertsLayout, recipe: Recipe, weight_storage: Precision = Precision.AS_IS,
    ) -> None:
        super().__init__()
        self.layout = layout
        gate_up: nn.Parameter = getattr(experts, layout.gate_up)
        self.num_experts, double, self.hidden_dim = gate_up.shape
        self.intermediate_dim = double // 2
        self.recipe = _experts_recipe(recipe)
        self._stored = tuple(
            self._add_stored_weight(name, getattr(experts, name), self.recipe, weight_storage)
            for name in (layout.gate_up, layout.down)
        )
        self._rules = tuple(CastRule.for_role(self.recipe, role) for role in TensorRole)
        self._grad_sinks: dict[str, torch.Tensor] = {}  # see _build_grad_routes
        self.compiled_casts = False  # see ``set_compiled_casts``
        if self.recipe.wgrad_hadamard:  # seeded: the same matrix on every rank and run
            self.register_buffer("hadamard", random_hadamard().to(gate_up.device), persistent=False)
        # The replaced module, outside the module tree: its activation or gate method
        # serves here, and ``to_module`` gives it back.
        self._replaced = (experts,)
        self.train(experts.training)

    @classmethod
    def from_module(
        cls, experts: nn.Module, recipe: Recipe, weight_storage: Precision = Precision.AS_IS
    ) -> "Fp8Experts":
        """Swap-in for the experts module ``experts`` that reuses its Parameters, stored
        at ``weight_storage``.

        Raises:
            ValueError: ``experts`` is no experts module amp8 can run in FP8; the message
                says why and what to do.
        """
        layout = experts_layout(experts)
        # Sharing with other modules is the model's business (``amp8.nn.swap.swap_experts``).
        reason = "it has no 3-D gate_up_proj and down_proj Parameters" if layout is None else experts_reason(
            experts, layout, shared={}
        )
        if reason is not None:
            raise ValueError(
                f"amp8 cannot run {type(experts).__name__} in FP8: {reason}. Keep it in high precision "
                "(amp8.initialize does, naming it), or give its class an amp8_experts_layout = "
                "amp8.nn.ExpertsLayout(...) naming its (E, 2I, H) and (E, H, I) Parameters and activation"
            )
        return cls(experts, layout, recipe, weight_storage)  # type: ignore[arg-type]

    @property
    def amp8_experts_layout(self) -> ExpertsLayout:
        """This module's layout: it is an experts module too (see ``amp8.nn.experts_layout``)."""
        return self.layout

    def stored_weights(self) -> tuple[StoredWeight, StoredWeight]:
        """The handles of the gate-up and down Parameters."""
        return self._stored  # type: ignore[return-value]

    _GRAD_ROUTES = ("_grad_sinks",)

    def _build_grad_routes(self) -> None:
        """A grad sink per weight FSDP2 shards (``amp8.nn.grad_routes.grad_sink``): it
        takes the gradient from backward and hands it to the weight's handle."""
        self._grad_sinks = {handle.name: grad_sink(handle) for handle in self._stored if handle.sharded}

    def to_module(self, real_weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """The experts module this one replaced, holding this module's Parameters, or,
        where they are stored scaled, plain Parameters of their real values
        (``real_weights[name]`` where given, such as O3's master weights)."""
        (experts,) = self._replaced
        for handle in self._stored:
            param = handle.param
            if handle.storage is not Precision.AS_IS:
                real = (real_weights or {}).get(handle.name)
                real = handle.read() if real is None else real
                param = nn.Parameter(real.clone(), requires_grad=param.requires_grad)
            setattr(experts, handle.name, param)
        experts.train(self.training)
        return experts

    def _gate(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """(tokens, 2I) -> (tokens, I): the replaced module's gate method, or its
        activation of the gate half times the up half."""
        (experts,) = self._replaced
        method = getattr(experts, self.layout.gate_method, None)
        if callable(method):
            return method
        activation = getattr(experts, self.layout.activation)

        def gate(projected: torch.Tensor) -> torch.Tensor:
            gate_half, up_half = projected.chunk(2, dim=-1)
            return activation(gate_half) * up_half

        return gate

    def set_compiled_casts(self, compiled: bool) -> None:
        """Run each expert's casts outside ``torch.compile`` (its tokens, its weights, its
        output gradient, its FP8 weight gradient) as amp8's compiled kernels (True) or as
        eager operations (False, the default); see ``amp8.nn.cast_kernels``. The bits
        are the same."""
        self.compiled_casts = compiled

    def quantizers(self) -> LinearQuantizers:
        """The casts of each tensor role (they record nothing), with the Hadamard
        rotation of wgrad's operands where the recipe asks for it, run compiled as
        ``compiled_casts`` says."""
        rotation = getattr(self, "hadamard", None)
        return LinearQuantizers(*(
            Quantizer(rule, rotation=None if role is TensorRole.WEIGHT else rotation, compiled=self.compiled_casts)
            for rule, role in zip(self._rules, TensorRole)
        ))

    # Eager inside a compiled model: the token counts per expert are read on the host and
    # each expert's casts depend on which experts got tokens, so a graph would recompile
    # at nearly every step (minutes each on a CPU).
    @torch.compiler.disable
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' sum for each token: (tokens, H) from (tokens, H) hidden states and
        (tokens, k) expert indices and routing weights. It runs eagerly in a compiled
        model (``torch.compile`` compiles the rest)."""
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"Fp8Experts expects hidden states of shape (tokens, {self.hidden_dim}), got "
                f"{tuple(hidden_states.shape)}; flatten the batch and sequence dims first"
            )
        tokens, k = top_k_index.shape
        routing = Routing.from_indices(top_k_index, self.num_experts)
        out_dtype = output_dtype(hidden_states)
        quantizers = self.quantizers()
        gate_up, down = self._stored
        # Padding rows gather the zero row appended to the input.
        x = nn.functional.pad(hidden_states, (0, 0, 0, 1)).index_select(0, routing.source)  # (rows, H)
        with torch.autocast(hidden_states.device.type, enabled=False):  # the GEMMs choose their own dtypes
            projected = self._project(x, gate_up, routing.groups, quantizers, out_dtype)  # (rows, 2I)
            activated = self._gate()(projected)  # (rows, I)
            y = self._project(activated, down, routing.groups, quantizers, out_dtype)  # (rows, H)
        per_pair = nn.functional.pad(y, (0, 0, 0, 1)).index_select(0, routing.rows)  # (tokens * k, H)
        weighted = per_pair * top_k_weights.reshape(-1, 1)
        return weighted.view(tokens, k, self.hidden_dim).sum(1).to(hidden_states.dtype)

    def _project(
        self, x: torch.Tensor, handle: StoredWeight, groups: ExpertGroups, quantizers: LinearQuantizers,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Each expert's rows of ``x`` times its (N, K) matrix of ``handle``'s weight,
        transposed; the weight's real values come from its storage, and its gradient
        goes back to the Parameter (an FP8 ``WeightGrad`` where the weight is stored)."""
        weight = handle.param
        out_features, in_features = weight.shape[1:]
        stored = handle.storage is not Precision.AS_IS
        config = LinearGemmConfig.build(
            self.recipe, in_features, out_features, fp8_wgrad=stored, update_history=False, out_dtype=out_dtype,
            grad_layout=handle.grad_layout if stored else None,
        )
        real = handle.read() if stored else None
        # A weight FSDP2 shards takes its gradient through its grad sink (FSDP2 would reduce a .grad).
        target = self._grad_sinks[handle.name] if handle.sharded and weight.requires_grad else weight
        return _Fp8ExpertsFunction.apply(x, target, real, groups, quantizers, config)

    def extra_repr(self) -> str:
        """Experts, sizes and recipe, for ``print(model)``."""
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"intermediate_dim={self.intermediate_dim}, format={self.recipe.fp8_format.value}, "
            f"granularity={self.recipe.granularity.value}"
        )


def _experts_recipe(recipe: Recipe) -> Recipe:
    """``recipe`` with current scaling where it is delayed: the experts' casts keep no
    amax history."""
    return recipe.replace(scaling=Scaling.CURRENT) if recipe.scaling is Scaling.DELAYED else recipe
