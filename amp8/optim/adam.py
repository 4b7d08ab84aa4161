"""``LowBitAdam``: Adam / AdamW over FP8 weight gradients, with low-bit state.

The update of every parameter is computed in float32 from dequantized state and stored
back at the precisions of the opt level: Adam's first moment in FP8 (E4M3, rounded
stochastically) and second in FP16 at O2 and O3, both with the same scale tiles, the step
held to exact Adam's bound on how far one step moves a weight (``amp8.optim.bound``); weights
of FP8 layers in FP16 with stochastic rounding (O1, O2), or FP8 weights beside FP16
master weights (O3). A step with any non-finite gradient changes nothing and is counted
in ``skipped_steps``; the device decides that, and the host never waits for it.

The optimizer does Adam and nothing else: it reaches FP8 layers' weights only through
their ``amp8.tensor.StoredWeight`` handles, and in data parallel it calls the object
attached to average its gradients (an ``amp8.optim.gradients.GradientAverage``, such as
``amp8.distributed.GradientReduction``) and knows nothing of process groups. A parameter's
update runs in an update group (``amp8.optim.update_groups``: one pass over flat buffers,
eager or compiled by ``torch.compile``), or alone as the reference step
(``amp8.optim.reference_step``: one eager operation at a time, the specification), both
encoding through ``amp8.quant.codec``. Stochastic rounding draws counter-based noise
(``amp8/quant/noise.py``): draw number ``n`` of the optimizer uses
``noise.rounding_key(seed, n)``, whichever path runs, so both paths round alike and a
checkpoint resumes the same noise from ``(seed, n)``.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from amp8.config.levels import O1, OptLevel, resolve_level
from amp8.config.validation import removed_name
from amp8._compiled import cpp_compiler_found
from amp8.optim import layer_state
from amp8.optim.checkpoint import Checkpoints
from amp8.optim.copies import BOUND_TO_PARAMS, Copies
from amp8.optim.data_parallel import DataParallel
from amp8.optim.gradients import GradientAverage
from amp8.optim.plain_step import plain_adam_step
from amp8.optim.plan import UpdatePlan, build_plan, step_inputs
from amp8.optim.spec import UpdateSpec
from amp8.optim.update_groups import UpdateGroup
from amp8.optim.reference_step import reference_update
from amp8.optim.stored_state import StoredState
from amp8.optim.support import (
    REMOVED_ATTRIBUTES, check_hyperparameters, check_options, check_removed_options, check_state_precision,
    check_supported, torch_groups,
)
from amp8.quant import noise
from amp8.tensor.stored import StoredWeight, stored_weight
from amp8.tensor.weight_grad import GradSlot

DEFAULT_STATE_BLOCK_SIZE = 0  # one scale per tensor; the measurements behind it are in docs/decisions.md
# From this many parameter elements on, fused=None compiles the step on the CPU too.
FUSED_CPU_MIN_ELEMENTS = 1 << 22


class LowBitAdam(Copies, DataParallel, Checkpoints, torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW (True) for amp8 models.

    Args:
        params: parameters or param groups, as for ``torch.optim.Adam``.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.Adam``.
        decoupled_weight_decay: AdamW's decay (``w *= 1 - lr * weight_decay``) when True.
        level: the opt level (or its name) whose ``exp_avg``, ``exp_avg_sq`` and
            ``master_weight`` columns set what the optimizer stores.
        state_block_size: elements per scale of low-bit moments (0: one scale per tensor).
        seed: seeds the stochastic rounding of FP16 weights (an int >= 0; saved in
            ``state_dict`` with the count of draws so far).
        fused: run each update group's step as one ``torch.compile``d function
            (``amp8.optim.group_step``): True anywhere (the CPU compiles it to C++), False
            never, None (default) for parameters on CUDA, and on the CPU for an
            optimizer over at least ``FUSED_CPU_MIN_ELEMENTS`` elements where a C++
            compiler is found (the compile, a few seconds per kind of tensor, pays for
            itself within a few hundred steps there, and sooner for larger models,
            ``bench/optimizer.py``). Tensors no group covers take the eager reference
            step either way. Both round with the same noise; they agree up to the
            compiler's reordering of float32 arithmetic. Plain float32 parameters with
            float32 moments (O1's biases and norms) take torch's fused Adam kernel, all of
            them in one call (``amp8.optim.plain_step``), either way.
        master_weights: ``{weight Parameter: float32 weight}`` to take O3's master
            weights from, where the layers already store less precise FP8 weights
            (default: each layer's stored weight); for a weight sharded over ranks,
            this rank's rows of it.
        grouped: update the tensors of one kind together, in one call over flat
            buffers that hold their moments and stored weights (``amp8.optim.update_groups``):
            a fixed number of operations (or compiled calls) per step, whatever the number
            of parameters. False updates each tensor on its own with the reference step
            (the same results, bit for bit eagerly; much slower over many tensors). Layouts a group does not cover
            (2-D tiles of scales, E8M0 scales, stacks of experts, sharded weights) take
            their own update either way.

    Data parallel: gradients are averaged by an object attached after construction
    (``attach_gradient_average``; ``amp8.initialize`` attaches an
    ``amp8.distributed.GradientReduction``, and ``GradientReduction.attach`` does it for an
    optimizer built by hand). At a level that shards the optimizer (O3), where FSDP2
    shards the FP8 layers' weights (``amp8.initialize`` does it), each rank keeps the
    master weights and moments of its rows of each of them.

    Frozen parameters (``requires_grad=False`` when the optimizer is built) get no state:
    no moments, no master weight, no update; an O3 layer's frozen weight stays FP8 and
    exactly as loaded. One unfrozen later takes its state at its first step.

    A parameter listed twice (torch warns at construction) is updated once per step.

    Copies: ``copy.deepcopy((model, optimizer))`` and pickling both together (``torch.save``
    of the objects) give a pair that trains as the original does, bit for bit, and apart
    from it. As with torch's optimizers, a copy keeps the param groups, the state and the
    hyperparameters and drops hooks (an ``amp8.Controller`` or LR scheduler stays with the
    original) and the attached gradient average (a copy averages over no ranks).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        maximize: bool = False,
        level: OptLevel | str = O1,
        state_block_size: int = DEFAULT_STATE_BLOCK_SIZE,
        seed: int = 0,
        fused: bool | None = None,
        master_weights: Mapping[nn.Parameter, torch.Tensor] | None = None,
        grouped: bool = True,
        **removed: Any,
    ) -> None:
        check_removed_options(removed)
        level = resolve_level(level)
        check_state_precision(level)
        check_hyperparameters(lr, betas, eps, weight_decay)
        check_options(seed, fused, state_block_size)
        if not isinstance(grouped, bool):
            raise TypeError(f"grouped={grouped!r} is not valid; use True or False")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
        )
        super().__init__(params, defaults)
        self.level = level
        params_in_order = list(dict.fromkeys(param for group in self.param_groups for param in group["params"]))
        # The weights of FP8 layers, found from the Parameters: amp8.initialize attached a
        # StoredWeight to each.
        self.weights: dict[nn.Parameter, StoredWeight] = {
            param: handle for param in params_in_order if (handle := stored_weight(param)) is not None
        }
        for handle in self.weights.values():
            if handle.grad_slot is None and not handle.sharded:  # compiled graphs take the group's later as is
                handle.grad_slot = GradSlot.empty()
        self.stored = StoredState(level, self.weights, state_block_size, seed, self._own_chunk, self._is_sharded)
        self._layer_modules = layer_state.fp8_layers(self.weights.values())
        self.fused = fused
        self._fused_on_cpu = (
            sum(p.numel() for p in params_in_order) >= FUSED_CPU_MIN_ELEMENTS and cpp_compiler_found()
        )
        self.grouped = grouped
        self._new_step_functions()
        self._skipped: torch.Tensor | None = None
        self._average: GradientAverage | None = None
        self._stepped = False
        if self.sharded:
            self._check_all_sharded()
        # State is complete from the start, so a fresh optimizer's state_dict has the
        # structure a checkpoint loads into (torch.distributed.checkpoint needs that).
        # A frozen parameter (``requires_grad=False``) gets none: no moments, no master.
        master_weights = master_weights or {}
        for param in params_in_order:
            if param.requires_grad:
                self.stored.init(param, self.state[param], master_weights.get(param))

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        level: OptLevel,
        replaced: Mapping[nn.Parameter, nn.Parameter] | None = None,
        **options: Any,
    ) -> "LowBitAdam":
        """The low-bit equivalent of a ``torch.optim.Adam`` or ``AdamW``: same param
        groups (with each Parameter that ``replaced`` maps swapped for its replacement,
        such as the sharded weights FSDP2 puts in place), same hyperparameters.
        ``options`` go to the constructor. The weights of FP8 layers are found from the
        Parameters themselves (``amp8.tensor.stored``).

        Raises:
            TypeError: for any other optimizer class.
            ValueError: for options amp8 does not support (amsgrad, differentiable), an
                optimizer that has already stepped, or one with an LR scheduler attached.
        """
        check_supported(optimizer)
        defaults = optimizer.defaults
        return cls(
            torch_groups(optimizer, dict(replaced or {})), lr=defaults["lr"], betas=defaults["betas"],
            eps=defaults["eps"], weight_decay=defaults["weight_decay"],
            decoupled_weight_decay=defaults.get(
                "decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)
            ),
            maximize=defaults.get("maximize", False), level=level, **options,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` as torch does (the FP8 weight gradients included), and the
        gradients that sharded weights keep on their handles."""
        super().zero_grad(set_to_none=set_to_none)
        for handle in self.weights.values():
            if handle.sharded:
                handle.clear_grad()
        if self._average is not None:
            self._average.reset()

    # -- weights and noise (see StoredState) ---------------------------------------
    @property
    def seed(self) -> int:
        """The stochastic-rounding seed (saved in ``state_dict``)."""
        return self.stored.seed

    @property
    def rounding_counter(self) -> int:
        """Stochastic-rounding draws so far (saved in ``state_dict``)."""
        return self.stored.rounding_counter

    @rounding_counter.setter
    def rounding_counter(self, value: int) -> None:
        self.stored.rounding_counter = value

    def __getattr__(self, name: str) -> Any:
        """Removed methods and attributes fail naming what replaces them. After a copy,
        what is bound to the Parameters is rebuilt here, on first use."""
        if name in BOUND_TO_PARAMS and "param_groups" in self.__dict__:
            self._bind_to_params()
            return self.__dict__[name]
        raise removed_name(type(self).__name__, name, REMOVED_ATTRIBUTES)

    def master_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The most precise real float32 values of ``param`` this rank has: its master
        weight where this rank keeps the whole of it (O3), else what the model stores."""
        if self._is_sharded(param):
            return self.weights[param].read()
        return self.stored.weight(param, self.state[param])

    def update_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Store float32 ``value`` as ``param``'s new weight, at the level's precisions."""
        self.stored.write_weight(param, self.state[param], value)

    # -- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One Adam step over every parameter with a gradient, or none if any overflowed.

        The host does not wait for the device: whether a gradient holds an inf or NaN is
        decided on the device, and a step that finds one writes back what it read
        (``skipped_steps`` counts it). With a gradient average attached, the ranks agree
        on skipping through the host (one sync)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.sharded:
            self._sharded_average()  # fails before anything changes
        if self.stored.plain_loads:  # one check per step; the layers are read only after a plain load
            self.stored.plain_loads.clear()
            lost = layer_state.lost_after_plain_load(self._layer_modules, bool(self._optimizer_state_dict_post_hooks))
            if lost is not None:
                warnings.warn(lost, stacklevel=2)
        self._stepped = True
        self.synchronize()
        plan = self._plan_for_step()
        try:
            skip = plan.nonfinite()
            if self._average is not None:
                skip = torch.tensor(self._average.any_rank(bool(skip)), device=skip.device)
            self._update_all(plan, skip)
            self._skipped = self._skipped + skip.to(self._skipped.device, torch.int64) if self._skipped is not None \
                else skip.to(torch.int64)
        finally:
            plan.end_step()
        if self._average is not None:
            self._average.end_round()
        return loss

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient held an inf or NaN (read from the device when asked)."""
        skipped = self.__dict__.get("_skipped")
        return 0 if skipped is None else int(skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = None if value == 0 else torch.tensor(int(value), dtype=torch.int64)

    def _plan_for_step(self) -> UpdatePlan:
        """This step's plan (``amp8.optim.update_groups``), built again where the last one
        no longer fits, with the gradients of its update groups copied into their buffers."""
        inputs = step_inputs(self)
        plan = self._plan
        if plan is None or not plan.fits(inputs) or not plan.gather(inputs):
            # The new groups copy from the old ones' views; what the old ones still hold
            # then gets memory of its own.
            old, plan = plan, build_plan(self, inputs)
            if old is not None:
                old.release()
            self._plan = plan
            if not plan.gather(inputs):
                raise RuntimeError("amp8: an update group does not hold the tensors it was just built from")
        plan.other_grads = [inputs.grads[position] for _, _, position in plan.alone]
        plan.sharded_grads = [self.gradient(param) for _, param, _ in plan.alone if self._is_sharded(param)]
        plan.plain_grads = [param.grad for params in plan.plain.values() for param in params]
        return plan

    def _update_all(self, plan: UpdatePlan, skip: torch.Tensor) -> None:
        """Every parameter's update with a gradient, each on the path ``plan`` gives it,
        rounding under the noise key the reference step would draw for it; nothing is
        written where ``skip``."""
        first_draw = self.stored.rounding_counter
        for (index, param, position), grad in zip(plan.alone, plan.other_grads):
            self.stored.rounding_counter = first_draw + plan.draws.get(param, 0)
            if self._is_sharded(param):
                grad = (self._sharded_average().averaged_chunk(param), None, None)
            if grad is None:
                continue
            reference_update(self.stored, param, self.state[param], grad, self.param_groups[index], skip)
        if self.sharded and not bool(skip):  # (the ranks agreed on ``skip`` through the host already)
            self.stored.store_sharded_weights(self.state, self._sharded_average().max_over_ranks)
        for (index, _), params in plan.plain.items():
            plain_adam_step(params, [self.state[param] for param in params], self.param_groups[index], skip)
        seed_part = noise.seed_key(self.seed)
        coefficients: dict[Any, Any] = {}
        for update_group in plan.groups:
            steps = self._group_steps[self._compiles(update_group.members[0].param)]
            update_group.run(steps, self.param_groups[update_group.key.param_group], seed_part, first_draw, skip,
                             coefficients)
        self.stored.rounding_counter = first_draw + plan.total_draws

    @property
    def update_groups(self) -> tuple[UpdateGroup, ...]:
        """The update groups the last step ran (empty before the first step), for
        inspection: each holds its ``key`` (param group, ``UpdateSpec``, row width), its
        ``members`` and its buffers (``tensors``; between steps, the buffers a step fills
        and empties again show as meta tensors). A step builds them again when what they
        hold changes."""
        return () if self._plan is None else tuple(self._plan.groups)

    @property
    def own_updates(self) -> tuple[nn.Parameter, ...]:
        """The parameters the last step updated one at a time with the reference step
        (layouts no group covers), for inspection."""
        return () if self._plan is None else tuple(entry.param for entry in self._plan.alone)

    @property
    def compiled_specs(self) -> tuple[UpdateSpec, ...]:
        """The ``UpdateSpec``s whose grouped step has been compiled (one graph each)."""
        return self._group_steps[True].specs

    def _drop_plan(self) -> None:
        """Forget the update groups, giving their members their own memory back."""
        if self._plan is not None:
            self._plan.release()
            self._plan = None

    def _compiles(self, param: nn.Parameter) -> bool:
        """Whether the update group of ``param`` runs compiled (see ``fused`` in the class
        docstring)."""
        if self.fused is not None:
            return self.fused
        return param.device.type == "cuda" or (param.device.type == "cpu" and self._fused_on_cpu)
