"""``LowBitAdam``: Adam / AdamW over FP8 weight gradients, with low-bit state.

The update of every parameter is computed in float32 from dequantized state and stored
back at the precisions of the opt level: Adam's first moment in FP8 (E4M3, rounded
stochastically) and second in FP16 at O2 and O3, both with the same scale tiles, the step
held to exact Adam's bound on how far one step moves a weight (``amp8.optim.bound``); weights
of FP8 layers in FP16 with stochastic rounding (O1, O2), or FP8 weights beside FP16
master weights (O3). A step with any non-finite gradient changes nothing and is counted
in ``skipped_steps``.

The optimizer does Adam and nothing else: it reaches FP8 layers' weights only through
their ``amp8.tensor.StoredWeight`` handles, and in data parallel it calls the object
attached to average its gradients (an ``amp8.optim.gradients.GradientAverage``, such as
``amp8.distributed.GradientReduction``) and knows nothing of process groups. Each tensor's update runs
either as the reference below (``_update``: one eager torch operation at a time) or
fused (``amp8/optim/fused.py`` compiled by ``torch.compile``). Stochastic rounding draws
counter-based noise (``amp8/quant/noise.py``): draw number ``n`` of the optimizer uses
``noise.rounding_key(seed, n)``, whichever path runs, so both paths round alike and a
checkpoint resumes the same noise from ``(seed, n)``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Iterable, Mapping

import torch
from torch import nn

from amp8.config.levels import O1, OptLevel, resolve_level
from amp8.config.validation import removed_name
from amp8.optim import checkpoint, layer_state
from amp8.optim.copies import BOUND_TO_PARAMS, Copies
from amp8.optim import fused as fused_step
from amp8.optim import state as state_storage
from amp8._compiled import cpp_compiler_found
from amp8.optim.plain_step import plain_adam_step, takes_plain_step
from amp8.optim.fused_update import fused_update, stored_grad
from amp8.optim.gradients import GradientAverage
from amp8.optim.state import MOMENTS
from amp8.optim.stored_state import StoredState
from amp8.optim.update_groups import StepInputs, UpdatePlan, build_groups
from amp8.optim.support import (
    REMOVED_ATTRIBUTES, check_hyperparameters, check_options, check_removed_options, check_state_precision,
    check_supported, torch_groups,
)
from amp8.quant import noise, scaling
from amp8.tensor.scaled import local_tensor
from amp8.tensor.stored import StoredWeight, float_grad, stored_weight

DEFAULT_STATE_BLOCK_SIZE = 0  # one scale per tensor; see the note in DESIGN.md
# From this many parameter elements on, fused=None compiles the step on the CPU too.
FUSED_CPU_MIN_ELEMENTS = 1 << 22
_EXTRA_STATE_KEY = "amp8"


class LowBitAdam(Copies, torch.optim.Optimizer):
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
        fused: run each tensor's update as one ``torch.compile``d function
            (``amp8.optim.fused``): True anywhere (the CPU compiles it to C++), False
            never, None (default) for parameters on CUDA, and on the CPU for an
            optimizer over at least ``FUSED_CPU_MIN_ELEMENTS`` elements where a C++
            compiler is found (the compile, a few seconds per kind of tensor, pays for
            itself within a few hundred steps there, and sooner for larger models: the
            fused step runs 3-8x faster than the reference on the CPU,
            ``bench/optimizer.py``). Where the fused step does
            not apply (the chunks of weights sharded over data-parallel ranks), those
            tensors take the reference step. Both round with the same noise; they agree
            up to the compiler's reordering of float32 arithmetic. Plain float32
            parameters with float32 moments (O1's biases and norms) take torch's fused
            Adam kernel, all of them in one call (``amp8.optim.plain_step``), either way.
        master_weights: ``{weight Parameter: float32 weight}`` to take O3's master
            weights from, where the layers already store less precise FP8 weights
            (default: each layer's stored weight); for a weight sharded over ranks,
            this rank's rows of it.
        grouped: update the tensors of one kind together, in one call over flat
            buffers that hold their moments and stored weights (``amp8.optim.update_groups``):
            a fixed number of operations (or compiled calls) per step, whatever the number
            of parameters. False updates each tensor on its own (the same results, bit for
            bit eagerly; much slower over many tensors). Layouts a group does not cover
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
        self.stored = StoredState(level, self.weights, state_block_size, seed, self._own_chunk, self._is_sharded)
        self._layer_modules = layer_state.fp8_layers(self.weights.values())
        self.fused = fused
        self._fused_on_cpu = (
            sum(p.numel() for p in params_in_order) >= FUSED_CPU_MIN_ELEMENTS and cpp_compiler_found()
        )
        self.grouped = grouped
        self._new_step_functions()
        self.skipped_steps = 0
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

    # -- data parallel (the attached average averages; the optimizer only calls it) ---
    def attach_gradient_average(self, average: GradientAverage) -> None:
        """Have ``average`` average this optimizer's gradients over data-parallel ranks:
        each step synchronizes it first, skips on every rank when any rank has a
        non-finite gradient, and ends its round last. ``amp8.initialize`` attaches an
        ``amp8.distributed.GradientReduction``; for an optimizer built by hand use
        ``amp8.distributed.GradientReduction.attach``. Attaching the attached one again
        does nothing.

        Raises:
            TypeError: ``average`` lacks a method of ``GradientAverage``.
            RuntimeError: another average is attached already, or the optimizer has taken
                a step (the ranks' weights may differ already).
            ValueError: the opt level shards the optimizer (O3) and an FP8 layer's weight
                is not sharded over the ranks.
        """
        if average is self._average:
            return
        if not isinstance(average, GradientAverage):
            raise TypeError(
                f"attach_gradient_average takes an amp8.optim.gradients.GradientAverage (such as "
                f"amp8.distributed.GradientReduction), got {type(average).__name__}"
            )
        if self._average is not None:
            raise RuntimeError(
                f"this LowBitAdam's gradients are averaged by a {type(self._average).__name__} "
                "already; attach one average per optimizer"
            )
        if self._stepped:
            raise RuntimeError(
                "attach the gradient average before the optimizer's first step: the ranks "
                "have stepped on gradients of their own since, and their weights may differ"
            )
        if self.level.shard_optimizer:
            self._check_all_sharded()
        self._average = average

    @property
    def gradient_average(self) -> GradientAverage | None:
        """What averages the gradients over data-parallel ranks (see
        ``attach_gradient_average``), or None."""
        return self._average

    @property
    def sharded(self) -> bool:
        """Whether FP8 layers' master weights and moments are sharded over ranks: the
        opt level shards the optimizer and FSDP2 shards the weights."""
        return self.level.shard_optimizer and any(handle.sharded for handle in self.weights.values())

    def _is_sharded(self, param: nn.Parameter) -> bool:
        handle = self.weights.get(param)
        return self.level.shard_optimizer and handle is not None and handle.sharded

    def _check_all_sharded(self) -> None:
        """Raise unless every FP8 layer's weight (but fixed-storage tables) is sharded."""
        unsharded = [p for p, handle in self.weights.items() if not (handle.sharded or handle.fixed_storage)]
        if unsharded:
            raise ValueError(
                f"opt level {self.level.name} in data parallel keeps each rank's rows of the FP8 "
                f"weights, but an FP8 layer's weight of shape {tuple(unsharded[0].shape)} is "
                "not sharded; let amp8.initialize build the optimizer, or shard the weights "
                "with amp8.distributed.fsdp.shard_weights first"
            )

    def no_sync(self) -> ContextManager[None]:
        """Context for the backward passes of gradient-accumulation micro-batches except
        the last: they start no communication (as ``DistributedDataParallel.no_sync``)."""
        return self._average.no_sync() if self._average is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        """Average every gradient over the data-parallel ranks (see
        ``attach_gradient_average``). ``step`` calls this when needed; call it yourself
        before anything that must see averaged gradients, such as clipping."""
        if self._average is not None:
            self._average.synchronize()

    def _sharded_average(self) -> GradientAverage:
        """The attached average, which the weights sharded over ranks need (their
        gradients and scales come from all ranks)."""
        if self._average is None:
            raise RuntimeError(
                "this LowBitAdam keeps each rank's rows of FP8 weights that FSDP2 shards over "
                "data-parallel ranks, and no gradient average is attached to it: before the first "
                "step call amp8.distributed.GradientReduction.attach(optimizer, "
                "amp8.distributed.data_parallel_group(model)), or let amp8.initialize build the optimizer"
            )
        return self._average

    def _own_chunk(self, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` whose state this rank keeps: all of it, or for a sharded
        weight this rank's rows, flat (``value`` must hold those rows already, as a
        sharded ``StoredWeight.read`` returns them)."""
        if not self._is_sharded(param):
            return value
        rows = local_tensor(param)
        if value.numel() != rows.numel():
            raise ValueError(
                f"the weight of shape {tuple(param.shape)} is sharded over data-parallel ranks and "
                f"this rank holds {rows.numel()} of its elements, but its master weight has "
                f"{value.numel()}; pass this rank's rows in master_weights"
            )
        return value.flatten()

    # -- gradients -------------------------------------------------------------------
    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """The float32 gradient of ``param``: its FP8 weight gradient or ``param.grad``
        (this rank's chunk of the averaged gradient for a sharded weight)."""
        if self._is_sharded(param):
            return self._sharded_average().averaged_chunk(param)
        return float_grad(param)

    def stored_gradients(self) -> list[torch.Tensor]:
        """Every gradient as stored (FP8 data, ``param.grad``, or the averaged chunk of a
        sharded weight), for finiteness checks."""
        stored = []
        for group in self.param_groups:
            for param in group["params"]:
                handle = self.weights.get(param)
                if self._is_sharded(param):
                    grad = self._sharded_average().averaged_chunk(param)
                elif handle is not None:
                    scaled = handle.grad()
                    grad = None if scaled is None else scaled.data
                else:
                    grad = param.grad
                if grad is not None:
                    stored.append(grad)
        return stored

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
        """One Adam step over every parameter with a gradient, or none if any overflowed."""
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
            nonfinite = not bool(scaling.all_finite(plan.gradients()))
            if self._average is not None:
                nonfinite = self._average.any_rank(nonfinite)
            if not nonfinite:
                self._update_all(plan)
                if self.sharded:
                    self.stored.store_sharded_weights(self.state, self._sharded_average().max_over_ranks)
            else:
                self.skipped_steps += 1
        finally:
            plan.end_step()
        if self._average is not None:
            self._average.end_round()
        return loss

    def _plan_for_step(self) -> UpdatePlan:
        """This step's plan (``amp8.optim.update_groups``), built again where the last one
        no longer fits, with the gradients of its update groups copied into their buffers."""
        inputs = self._step_inputs()
        plan = self._plan
        if plan is None or not plan.fits(inputs) or not plan.gather(inputs):
            # The new groups copy from the old ones' views; what the old ones still hold
            # then gets memory of its own.
            old, plan = plan, self._build_plan(inputs)
            if old is not None:
                old.release()
            self._plan = plan
            if not plan.gather(inputs):
                raise RuntimeError("amp8: an update group does not hold the tensors it was just built from")
        plan.other_grads = [
            grad[0] if (grad := inputs.grads[position]) is not None else self.gradient(param)
            for _, param, position in plan.alone
        ] + [param.grad for params in plan.plain.values() for param in params]
        return plan

    def _update_all(self, plan: UpdatePlan) -> None:
        """Every parameter's update with a gradient, each on the path ``plan`` gives it,
        rounding under the noise key the reference step would draw for it."""
        first_draw = self.stored.rounding_counter
        for index, param, _ in plan.alone:
            self.stored.rounding_counter = first_draw + plan.draws.get(param, 0)
            group = self.param_groups[index]
            if self._runs_fused(param) and fused_update(
                self._fused_steps, param, self.weights.get(param), self.state[param], group,
                lambda: self.stored.update_noise_key(param),
            ):
                continue
            grad = self.gradient(param)
            if grad is not None:
                self._update(param, grad, group)
        for (index, _), params in plan.plain.items():
            plain_adam_step(params, [self.state[param] for param in params], self.param_groups[index])
        seed_part = noise.seed_key(self.seed)
        for update_group in plan.groups:
            compiled = self._runs_fused(update_group.members[0].param)
            update_group.run(
                self._group_steps[compiled], self.param_groups[update_group.key.param_group],
                seed_part, first_draw, as_tensors=compiled,
            )
        self.stored.rounding_counter = first_draw + plan.total_draws

    def _step_inputs(self) -> StepInputs:
        """What each parameter's update is this step, with the stored gradient and state
        of each "update" one (``StepInputs``). A parameter trainable since the optimizer
        was built gets its state here."""
        inputs = StepInputs([], [], [], [])
        params, kinds, grads, states_now = inputs.params, inputs.kinds, inputs.grads, inputs.states
        states, weights, shard_optimizer = self.state, self.weights, self.level.shard_optimizer
        seen: set[nn.Parameter] = set()
        for group in self.param_groups:
            for param in group["params"]:
                param_state = states.get(param)
                grad = None
                if param in seen:
                    kind = "skip"  # listed again: updated once, where it is listed first
                elif not param_state and not param.requires_grad:
                    kind = "skip"  # frozen: no state, no update
                else:
                    if not param_state:
                        # Frozen when this optimizer was built, trainable since: its state
                        # starts now (at O3 its master from the FP8 weight).
                        param_state = states[param]
                        self.stored.init(param, param_state, None)
                    handle = weights.get(param)
                    if handle is not None and handle.sharded and shard_optimizer:
                        kind = "sharded" if self.gradient(param) is not None else "skip"
                    elif handle is None and takes_plain_step(param, param_state):
                        kind = "plain"
                    else:
                        grad = stored_grad(param, handle)
                        kind = "skip" if grad is None else "update"
                seen.add(param)
                params.append(param)
                kinds.append(kind)
                grads.append(grad)
                states_now.append(param_state if grad is not None else None)
        return inputs

    def _params_in_order(self) -> list[tuple[int, nn.Parameter]]:
        """``(param group index, param)`` of every parameter, in order."""
        return [(index, param) for index, group in enumerate(self.param_groups) for param in group["params"]]

    def _drop_plan(self) -> None:
        """Forget the update groups, giving their members their own memory back."""
        if self._plan is not None:
            self._plan.release()
            self._plan = None

    def _build_plan(self, inputs: StepInputs) -> UpdatePlan:
        """Sort the parameters by their kinds in ``inputs`` into update groups, the plain
        step and their own updates, and number their noise draws in the reference step's
        order."""
        params = self._params_in_order()
        draws_stochastically = state_storage.rounds_stochastically(MOMENTS[0], self.level.exp_avg)
        draws: dict[nn.Parameter, int] = {}
        plain: dict[tuple[int, torch.device], list[nn.Parameter]] = {}
        candidates, alone = [], []
        for position, ((index, param), kind) in enumerate(zip(params, inputs.kinds)):
            if kind == "plain":
                plain.setdefault((index, param.device), []).append(param)
                continue
            if kind == "skip":
                continue
            if param in self.weights or draws_stochastically:
                draws[param] = len(draws)
            if kind == "update" and self.grouped:
                candidates.append((
                    index, param, self.weights.get(param), self.state[param], self.param_groups[index],
                    draws.get(param, 0), inputs.grads[position], position,
                ))
            else:
                alone.append((index, param, position))
        groups, ungrouped = build_groups(candidates)
        alone = sorted(alone + ungrouped, key=lambda entry: entry[2])
        return UpdatePlan(inputs.params, inputs.kinds, groups, alone, plain, draws, len(draws))

    def _runs_fused(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s update takes the fused step (see ``fused`` in the class
        docstring); sharded weights keep the reference step."""
        if self.fused is not None:
            wanted = self.fused
        else:
            wanted = param.device.type == "cuda" or (param.device.type == "cpu" and self._fused_on_cpu)
        return wanted and not self._is_sharded(param)

    def _update(self, param: nn.Parameter, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """``param``'s update, one eager operation at a time: the reference step."""
        param_state = self.state[param]
        exp_avg, exp_avg_sq = (state_storage.load(param_state, key) for key in MOMENTS)
        weight = self.stored.weight(param, param_state)
        param_state["step"] += 1
        scalars = fused_step.coefficients(group, float(param_state["step"]), as_tensors=False)
        # Stored moments: the step is held to exact Adam's bound (amp8.optim.bound).
        exp_avg, exp_avg_sq, weight = fused_step.adam_arithmetic(
            grad, exp_avg, exp_avg_sq, weight, scalars,
            decay=fused_step.decay_of(group), maximize=bool(group["maximize"]),
            bounded=state_storage.low_bit_moments(param_state),
        )
        noise_key = self.stored.update_noise_key(param)
        for key, value in zip(MOMENTS, (exp_avg, exp_avg_sq)):
            self.stored.store_moment(param, param_state, key, value, noise_key)
        self.stored.write_weight(param, param_state, weight, noise_key)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus amp8's counters and the stochastic-rounding
        seed and count of draws (all the noise of the rest of the run depends on). Low-bit
        state carries a marker that makes ``torch.optim.Adam.load_state_dict`` refuse it
        (see ``amp8.optim.checkpoint``; ``amp8.optim.to_torch_state_dict`` converts)."""
        state = super().state_dict()
        if checkpoint.has_low_bit_state(self.level):
            state = checkpoint.with_marker(state, self.level)
        state[_EXTRA_STATE_KEY] = {
            "skipped_steps": self.skipped_steps,
            "rounding": {"seed": self.seed, "counter": self.rounding_counter},
            layer_state.LAYERS_KEY: layer_state.layer_states(self.weights, checkpoint.param_indices(self.param_groups)),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore exactly what ``state_dict()`` saved, the FP8 layers' state with it.

        torch's loader casts floating state to each parameter's dtype, which would round
        FP32 moments to FP16 and break FP8 ones; amp8 restores every tensor as saved. State
        saved at other precisions (another opt level) is converted to this optimizer's,
        with a warning that says so. Each FP8 layer takes back its amax histories, GEMM
        precision and weight scales, its weight re-encoded under those scales from the
        real values the model holds (``amp8.optim.layer_state``): after the model's plain
        ``state_dict`` (loaded before or after this), the run resumes bit for bit.
        """
        state_dict = checkpoint.without_marker(dict(state_dict))
        extra = state_dict.pop(_EXTRA_STATE_KEY, {})
        self._drop_plan()
        params = [p for group in self.param_groups for p in group["params"]]
        layer_state.restore_layer_states(self.weights, params, extra.get(layer_state.LAYERS_KEY, {}))
        super().load_state_dict(state_dict)
        converted = checkpoint.restore_state(self.state, params, state_dict, self.stored.convert)
        if converted:
            warnings.warn(
                f"amp8: the optimizer checkpoint was saved at other precisions; converted "
                f"{', '.join(sorted(converted))} to opt level {self.level.name}",
                stacklevel=2,
            )
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        rounding = extra.get("rounding")
        if rounding is not None:
            self.stored.seed, self.stored.rounding_counter = int(rounding["seed"]), int(rounding["counter"])
        elif "generators" in extra:
            warnings.warn(
                "amp8: the optimizer checkpoint holds torch.Generator states for stochastic "
                "rounding, from an amp8 before counter-based rounding; they are ignored and "
                f"rounding continues from seed {self.seed}, so the resumed run rounds with "
                "other random bits than the saved one would have (with the same statistics)",
                stacklevel=2,
            )
