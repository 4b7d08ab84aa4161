"""``LowBitAdam``: Adam / AdamW over FP8 weight gradients, with low-bit state.

The update of every parameter is computed in float32 from dequantized state and stored
back at the precisions of the opt level: Adam's first moment in FP8 (E4M3) and second
in FP16 at O2 and O3, each with one scale per block; weights of FP8 layers in FP16 with
stochastic rounding (O1, O2), or FP8 weights beside FP16 master weights (O3). A step with
any non-finite gradient changes nothing and is counted in ``skipped_steps``.

Each tensor's update runs either as the reference below (``_update``: one eager torch
operation at a time) or fused (``amp8/optim/fused.py`` compiled by ``torch.compile``).
Stochastic rounding draws counter-based noise (``amp8/noise.py``): draw number ``n`` of
the optimizer uses ``noise.rounding_key(seed, n)``, whichever path runs, so both paths
round alike and a checkpoint resumes the same noise from ``(seed, n)``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .. import noise, scaling
from ..formats import E4M3
from ..checks import check_loaded_scales
from ..levels import O1, OptLevel, Precision, resolve_level
from ..stored_weight import StoredWeight, encode_fp16, stored_weight
from ..tensor import is_sharded, local_tensor
from ..comm.buckets import GradientBuckets
from ..comm.data_parallel import DataParallel, agree_on_delayed_scales
from . import fused as fused_step
from . import state as state_storage

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
DEFAULT_STATE_BLOCK_SIZE = 0  # one scale per tensor; see the note in DESIGN.md
_EXTRA_STATE_KEY = "amp8"
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MASTER = "master"


class LowBitAdam(torch.optim.Optimizer):
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
        data_parallel: the process group to average gradients over in FP8 (default: the
            one ``amp8.initialize`` found for these weights, if any); at a level
            that shards the optimizer (O3), each rank keeps the master weights and moments
            of its rows of every FP8 layer's weight, whose FP8 data FSDP2 must already
            shard (``amp8.comm.fsdp.shard_weights``; ``amp8.initialize`` does it).
        overlap_communication: in data parallel, start each bucket's FP8 all-to-all
            during backward, as soon as its gradients are final (else all at ``step``).
        fused: run each tensor's update as one ``torch.compile``d function
            (``amp8.optim.fused``): True anywhere (the CPU compiles it to C++), False
            never, None (default) for parameters on CUDA only. Where the fused step does
            not apply (the chunks of weights sharded over data-parallel ranks), those
            tensors take the reference step. Both round with the same noise; they agree
            up to the compiler's reordering of float32 arithmetic.
        master_weights: ``{weight Parameter: full float32 weight}`` to take O3's master
            weights from, where the layers already store less precise FP8 weights
            (default: each layer's stored weight).
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
        data_parallel: DataParallel | None = None,
        overlap_communication: bool = True,
        fused: bool | None = None,
        master_weights: Mapping[nn.Parameter, torch.Tensor] | None = None,
    ) -> None:
        level = resolve_level(level)
        check_state_precision(level)
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not valid; use an int >= 0")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused={fused!r} is not valid; use True, False or None (fused on CUDA only)")
        if isinstance(state_block_size, bool) or not isinstance(state_block_size, int) or state_block_size < 0:
            raise ValueError(f"state_block_size={state_block_size!r} is not valid; use an int >= 0")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
        )
        super().__init__(params, defaults)
        self.level = level
        # The weights of FP8 layers, found from the Parameters: amp8.initialize attached a
        # StoredWeight to each.
        self.weights: dict[nn.Parameter, StoredWeight] = {
            param: handle for group in self.param_groups for param in group["params"]
            if (handle := stored_weight(param)) is not None
        }
        if data_parallel is None:
            data_parallel = next((h.data_parallel for h in self.weights.values() if h.data_parallel), None)
        self.state_block_size = state_block_size
        self.seed = seed
        self.rounding_counter = 0  # stochastic-rounding draws so far
        self.fused = fused
        self._fused_steps = fused_step.FusedAdam()
        self.skipped_steps = 0
        self.data_parallel = data_parallel
        self._shard_grads: dict[nn.Parameter, torch.Tensor] = {}
        self._synchronized = False
        unsharded = [p for p in self.weights if self._is_sharded(p) and not is_sharded(p)]
        if unsharded:
            raise ValueError(
                f"opt level {level.name} in data parallel keeps each rank's rows of the FP8 "
                f"weights, but an FP8 layer's weight of shape {tuple(unsharded[0].shape)} is "
                "not sharded; let amp8.initialize build the optimizer, or shard the weights "
                "with amp8.comm.fsdp.shard_weights first"
            )
        # State is complete from the start, so a fresh optimizer's state_dict has the
        # structure a checkpoint loads into (torch.distributed.checkpoint needs that).
        master_weights = master_weights or {}
        for group in self.param_groups:
            for param in group["params"]:
                self._init_state(param, master_weights.get(param))
        self._buckets: GradientBuckets | None = None
        self._buckets_under: Any = None  # the DDP the buckets were built for (None: none)
        self._hook_handles: list[Any] = []
        if data_parallel is not None and overlap_communication:
            self._register_hooks([p for group in self.param_groups for p in group["params"]])

    def _reduction(self) -> GradientBuckets | None:
        """The gradient buckets: every gradient, or only the FP8 weights' once the user's
        DDP (which averages the others) runs the model; None outside data parallel."""
        data_parallel = self.data_parallel
        if data_parallel is None:
            return None
        if self._buckets is None or self._buckets_under is not data_parallel.ddp:
            covered = [
                p for group in self.param_groups for p in group["params"]
                if data_parallel.ddp is None or p in self.weights
            ]
            paused = self._buckets is not None and self._buckets.is_paused
            self._buckets = GradientBuckets(
                data_parallel, covered, self._local_gradient, self._has_local_gradient, self._is_sharded
            )
            self._buckets.is_paused = paused
            self._buckets_under = data_parallel.ddp
        return self._buckets

    def _grad_ready(self, param: nn.Parameter) -> None:
        buckets = self._reduction()
        if buckets is None:
            return
        self._synchronized = False  # a backward after an average starts a new round
        buckets.grad_ready(param)
        # Under the user's DDP, trainers clip right after backward, on DDP's averaged
        # gradients: average the FP8 weights' ones as soon as all their buckets are out.
        if self.data_parallel.ddp is not None and buckets.all_started:  # type: ignore[union-attr]
            self.synchronize()

    def _register_hooks(self, params: list[nn.Parameter]) -> None:
        """Tell the buckets when each gradient is final: through the stored weight's
        grad-ready hook, or the parameter's post-accumulate-grad hook."""
        for param in params:
            handle = self.weights.get(param)
            if handle is not None:
                # The hook gets the layer's weight as it is in backward: under FSDP2 the
                # gathered Parameter, not the sharded one the buckets know.
                hook = functools.partial(_ready, self._grad_ready, param)
                self._hook_handles.append(handle.register_grad_ready_hook(hook))
            else:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def no_sync(self) -> Any:
        """Context for the backward passes of gradient-accumulation micro-batches except
        the last: they start no communication (as ``DistributedDataParallel.no_sync``)."""
        buckets = self._reduction()
        return buckets.paused() if buckets is not None else contextlib.nullcontext()

    def _init_state(self, param: nn.Parameter, master_weight: torch.Tensor | None = None) -> None:
        """Step 0, zero moments at the level's precisions, and the master weight (from
        ``master_weight``, else from the stored weight)."""
        param_state = self.state[param]
        handle = self.weights.get(param)
        if handle is not None and self.level.master_weight is not None:
            real = master_weight if master_weight is not None else handle.read()
            self._store_master(param_state, self._own_chunk(param, real))
        shape_source = param_state.get(_MASTER, param)
        param_state["step"] = torch.zeros((), dtype=torch.float32)
        for key in _MOMENTS:
            zeros = torch.zeros(shape_source.shape, dtype=torch.float32, device=param.device)
            self._store_moment(param, param_state, key, zeros)

    # -- sharding --------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether FP8 layers' master weights and moments are sharded over ranks."""
        return self.data_parallel is not None and self.level.shard_optimizer

    def _is_sharded(self, param: nn.Parameter) -> bool:
        return self.sharded and param in self.weights

    def _own_chunk(self, param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` whose state this rank keeps: all of it, or for a sharded
        weight this rank's rows, flat. ``value`` is shaped like ``param``, or is already
        this rank's rows (what a sharded ``StoredWeight.read`` returns)."""
        if not self._is_sharded(param):
            return value
        if value.shape != param.shape:
            return value.flatten()
        start, end = self.data_parallel.shard_range(param.shape)  # type: ignore[union-attr]
        return value.flatten()[start:end]

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
        Parameters themselves (``amp8.stored_weight``).

        Raises:
            TypeError: for any other optimizer class.
            ValueError: for options amp8 does not support (amsgrad, differentiable), an
                optimizer that has already stepped, or one with an LR scheduler attached.
        """
        check_supported(optimizer)
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        groups = []
        for group in optimizer.param_groups:
            copied = {key: value for key, value in group.items() if key not in _TORCH_ONLY_KEYS}
            copied["params"] = [(replaced or {}).get(param, param) for param in group["params"]]
            copied.setdefault("decoupled_weight_decay", decoupled)
            groups.append(copied)
        defaults = optimizer.defaults
        return cls(
            groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            decoupled_weight_decay=defaults.get("decoupled_weight_decay", decoupled),
            maximize=defaults.get("maximize", False), level=level,
            **options,
        )

    # -- gradients -------------------------------------------------------------------
    def gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """The float32 gradient of ``param``: its FP8 weight gradient or ``param.grad``
        (this rank's chunk of the averaged gradient for a sharded weight)."""
        if param in self._shard_grads:
            return self._shard_grads[param]
        return self._local_gradient(param)

    def _local_gradient(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient as this rank's backward left it, in float32."""
        handle = self.weights.get(param)
        if handle is not None:
            grad = handle.grad()
            return None if grad is None else grad.dequantize()
        return None if param.grad is None else param.grad.float()

    def _has_local_gradient(self, param: nn.Parameter) -> bool:
        """Whether this rank's backward left ``param`` a gradient (nothing dequantized)."""
        handle = self.weights.get(param)
        return (handle.grad() if handle is not None else param.grad) is not None

    def stored_gradients(self) -> list[torch.Tensor]:
        """Every gradient as stored (FP8 data or ``param.grad``), for finiteness checks."""
        stored = []
        for group in self.param_groups:
            for param in group["params"]:
                handle = self.weights.get(param)
                grad = None if handle is None else handle.grad()
                if param in self._shard_grads:
                    stored.append(self._shard_grads[param])
                elif grad is not None:
                    stored.append(grad.data)
                elif handle is None and param.grad is not None:
                    stored.append(param.grad)
        return stored

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``param.grad`` as torch does (the FP8 weight gradients included), and the
        gradients that sharded weights keep on their handles."""
        super().zero_grad(set_to_none=set_to_none)
        for handle in self.weights.values():
            if handle.sharded:
                handle.clear_grad()
        self._end_round()
        buckets = self._reduction()
        if buckets is not None:
            buckets.reset()

    def _end_round(self) -> None:
        """Forget this step's averaged chunks: the next backward starts a new round."""
        self._shard_grads = {}
        self._synchronized = False

    def synchronize(self) -> None:
        """Average every gradient over the data-parallel ranks, FP8 on the wire.

        Replicated gradients are replaced by the mean in place (``param.grad``, or the
        FP8 ``weight_grad`` re-stored from it); a sharded weight keeps only this rank's
        chunk of the mean, for the step. ``step`` calls this when needed; call it yourself
        before anything that must see averaged gradients, such as clipping.
        """
        buckets = self._reduction()
        if buckets is None or self._synchronized:
            return
        means, chunks = buckets.finish()
        for param, mean in means.items():
            handle = self.weights.get(param)
            if handle is not None:
                handle.set_grad_from_float(mean.view(param.shape))
            else:
                param.grad = mean.view(param.shape).to(param.dtype)
        for param, chunk in chunks.items():
            self._shard_grads[param] = chunk
            self.weights[param].clear_grad()
        agree_on_delayed_scales(self.data_parallel, list(self.weights.values()))  # type: ignore[arg-type]
        self._synchronized = True

    # -- weights ---------------------------------------------------------------------
    def _next_noise_key(self) -> torch.Tensor:
        """The noise key of the next stochastic rounding (an int64 CPU scalar, which
        serves tensors on any device), counting the draw."""
        key = noise.rounding_key(self.seed, self.rounding_counter)
        self.rounding_counter += 1
        return torch.tensor(key, dtype=torch.int64)

    def _store_master(self, param_state: dict[str, Any], value: torch.Tensor) -> None:
        """Store a master weight as FP16 weights are stored (``encode_fp16``)."""
        param_state[_MASTER], param_state[_MASTER + state_storage.SCALE_SUFFIX] = encode_fp16(
            value, self._next_noise_key(), previous=param_state.get(_MASTER + state_storage.SCALE_SUFFIX)
        )

    def read_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The real float32 values of ``param``: its master weight where this rank keeps
        the whole of it, else what the model stores."""
        param_state = self.state[param]
        if _MASTER in param_state and not self._is_sharded(param):
            return state_storage.load(param_state, _MASTER)
        handle = self.weights.get(param)
        return handle.read() if handle is not None else param.detach().float()

    def write_weight(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Store float32 ``value`` into ``param``: its master weight and FP8 storage (O3),
        its FP16 storage with stochastic rounding (O1, O2), or the parameter itself."""
        handle = self.weights.get(param)
        param_state = self.state[param]
        if _MASTER in param_state:
            self._store_master(param_state, value)
            if not self._is_sharded(param):
                handle.write(value)  # type: ignore[union-attr]
        elif handle is not None:
            handle.write(value, noise_key=self._next_noise_key())
        else:
            param.copy_(value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One Adam step over every parameter with a gradient, or none if any overflowed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        nonfinite = not bool(scaling.all_finite(self.stored_gradients()))
        if self.data_parallel is not None:
            nonfinite = self.data_parallel.any_rank(nonfinite)
        if nonfinite:
            self.skipped_steps += 1
            self._end_round()
            return loss
        for group in self.param_groups:
            for param in group["params"]:
                if self._runs_fused(param):
                    self._fused_update(param, group)
                    continue
                grad = self.gradient(param)
                if grad is not None:
                    self._update(param, grad, group)
        if self.sharded:
            self._store_sharded_weights()
        self._end_round()
        return loss

    def _store_sharded_weights(self) -> None:
        """Each rank's rows of every sharded weight, cast from its master rows to FP8 with
        one scale per weight (from the amax over all ranks), stored in place; FSDP2
        all-gathers them before the next forward."""
        params = [p for p in self.weights if _MASTER in self.state[p]]
        if not params:
            return
        chunks = [state_storage.load(self.state[p], _MASTER) for p in params]
        local_amax = torch.stack([chunk.abs().amax() if chunk.numel() else chunk.new_zeros(()) for chunk in chunks])
        global_amax = self.data_parallel.max_over_ranks(local_amax)  # type: ignore[union-attr]
        for param, chunk, amax in zip(params, chunks, global_amax):  # step() runs under no_grad
            handle = self.weights[param]
            data, scale = handle.encode(chunk, amax_value=amax)
            handle.store(data.view(local_tensor(param).shape), scale)

    def _precision(self, key: str) -> Precision:
        """Storage of moment ``key`` ("exp_avg" or "exp_avg_sq"), the level's column."""
        return getattr(self.level, key)

    # -- the fused step ---------------------------------------------------------------
    def _runs_fused(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s update takes the fused step (see ``fused`` in the class
        docstring); sharded weights keep the reference step."""
        wanted = param.device.type == "cuda" if self.fused is None else self.fused
        return wanted and not self._is_sharded(param)

    def _fused_update(self, param: nn.Parameter, group: dict[str, Any]) -> None:
        """``param``'s update through ``fused.adam_tensor_step``: the same operations as
        ``_update``, read from and written to the stored tensors."""
        handle = self.weights.get(param)
        if handle is not None:
            scaled_grad = handle.grad()
            if scaled_grad is None:
                return
            grad, grad_scale = scaled_grad.data, scaled_grad.scale
            grad_storage = _scale_storage(grad, grad_scale, scaled_grad.block_size)
        else:
            if param.grad is None:
                return
            grad, grad_scale, grad_storage = param.grad, None, fused_step.Storage()
        param_state = self.state[param]
        moments = [_stored(param_state, key) for key in _MOMENTS]
        if _MASTER in param_state:
            kind = fused_step.WeightKind.MASTER
            weight, weight_scale = _stored(param_state, _MASTER)[:2]
        elif handle is not None:
            kind = fused_step.WeightKind.FP16_SCALED
            weight, weight_scale = handle.param.detach(), handle.scale
        else:
            kind, weight, weight_scale = fused_step.WeightKind.PLAIN, param.detach(), None
        fp8_storage, fp8_previous = fused_step.Storage(), False
        if kind is fused_step.WeightKind.MASTER:
            fp8_storage, fp8_previous = _fp8_weight_storage(handle)  # type: ignore[arg-type]
        storages = (grad_storage, moments[0][2], moments[1][2], fp8_storage)
        if any(storage is None for storage in storages):  # a scale layout the fused step lacks
            reference_grad = self.gradient(param)
            self._update(param, reference_grad, group)  # type: ignore[arg-type]
            return
        weight_decay = group["weight_decay"]
        decay = (
            fused_step.Decay.NONE if weight_decay == 0
            else fused_step.Decay.DECOUPLED if group["decoupled_weight_decay"] else fused_step.Decay.L2
        )
        layout = fused_step.Layout(
            grad=grad_storage, exp_avg=moments[0][2], exp_avg_sq=moments[1][2],  # type: ignore[arg-type]
            weight=kind, decay=decay, maximize=bool(group["maximize"]),
            fp8_weight=fp8_storage,  # type: ignore[arg-type]
            fp8_margin=handle.recipe.margin if handle is not None else 0,
            fp8_power_of_2=handle.recipe.power_of_2_scales if handle is not None else False,
            fp8_previous_scale=fp8_previous,
        )
        param_state["step"] += 1
        (beta1, beta2) = group["betas"]
        scalars = fused_step.coefficients(
            group["lr"], beta1, beta2, group["eps"], weight_decay, group["decoupled_weight_decay"],
            float(param_state["step"]),
        )
        noise_key = self._next_noise_key() if kind is not fused_step.WeightKind.PLAIN else torch.zeros((), dtype=torch.int64)
        tensors = fused_step.Tensors(
            grad, grad_scale, moments[0][0], moments[0][1], moments[1][0], moments[1][1],
            weight, weight_scale, handle.scale if handle is not None and fp8_previous else None,
        )
        result = self._fused_steps(layout, tensors, scalars, noise_key)
        for key, data, scale in zip(
            _MOMENTS, (result.exp_avg, result.exp_avg_sq), (result.exp_avg_scale, result.exp_avg_sq_scale)
        ):
            param_state[key] = data
            if scale is not None:
                param_state[key + state_storage.SCALE_SUFFIX] = scale
        if kind is fused_step.WeightKind.PLAIN:
            param.copy_(result.weight)
        elif kind is fused_step.WeightKind.FP16_SCALED:
            handle.store(result.weight, result.weight_scale)  # type: ignore[union-attr, arg-type]
        else:
            param_state[_MASTER], param_state[_MASTER + state_storage.SCALE_SUFFIX] = result.weight, result.weight_scale
            handle.store(result.fp8_weight, result.fp8_weight_scale)  # type: ignore[union-attr, arg-type]

    def _update(self, param: nn.Parameter, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """``param``'s update, one eager operation at a time: the reference step."""
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay = group["weight_decay"]
        if group["maximize"]:
            grad = -grad
        param_state = self.state[param]
        exp_avg, exp_avg_sq = (state_storage.load(param_state, key) for key in _MOMENTS)
        weight = (
            state_storage.load(param_state, _MASTER) if _MASTER in param_state else self.read_weight(param)
        )
        param_state["step"] += 1
        step = float(param_state["step"])
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                weight.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(weight, alpha=weight_decay)
        # Same operations, in the same order, as torch.optim.Adam(foreach=False).
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-step_size)
        for key, value in zip(_MOMENTS, (exp_avg, exp_avg_sq)):
            self._store_moment(param, param_state, key, value)
        self.write_weight(param, weight)

    def _store_moment(
        self, param: nn.Parameter, param_state: dict[str, Any], key: str, value: torch.Tensor
    ) -> None:
        """Store a moment at its level's precision; the FP8 first moment of an FP8
        layer's weight takes the tiles of that layer's weight scales (rowwise or block
        recipes), other low-bit moments ``state_block_size``."""
        handle = self.weights.get(param)
        tile = None if handle is None else handle.tile()
        state_storage.store(param_state, key, value, self._precision(key), self.state_block_size, tile)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus amp8's counters and the stochastic-rounding
        seed and count of draws (all the noise of the rest of the run depends on)."""
        state = super().state_dict()
        state[_EXTRA_STATE_KEY] = {
            "skipped_steps": self.skipped_steps,
            "rounding": {"seed": self.seed, "counter": self.rounding_counter},
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore exactly what ``state_dict()`` saved.

        torch's loader casts floating state to each parameter's dtype, which would round
        FP32 moments to FP16 and break FP8 ones; amp8 restores every tensor as saved. State
        saved at other precisions (another opt level) is converted to this optimizer's,
        with a warning that says so.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_EXTRA_STATE_KEY, {})
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        # int() because torch.distributed.checkpoint hands the ids back as strings.
        saved_ids = [int(i) for group in state_dict["param_groups"] for i in group["params"]]
        by_id = dict(zip(saved_ids, params))
        converted: set[str] = set()
        for param_id, saved in _merge_string_ids(state_dict["state"]).items():
            param = by_id[param_id]
            param_state = {
                key: value.detach().clone().to(param.device) if torch.is_tensor(value) else value
                for key, value in saved.items()
            }
            for key, value in param_state.items():
                if key.endswith(state_storage.SCALE_SUFFIX):
                    check_loaded_scales(f"state[{param_id}][{key!r}]", value)
            converted |= self._convert(param, param_state)
            self.state[param] = param_state
        if converted:
            warnings.warn(
                f"amp8: the optimizer checkpoint was saved at other precisions; converted "
                f"{', '.join(sorted(converted))} to opt level {self.level.name}",
                stacklevel=2,
            )
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        rounding = extra.get("rounding")
        if rounding is not None:
            self.seed, self.rounding_counter = int(rounding["seed"]), int(rounding["counter"])
        elif "generators" in extra:
            warnings.warn(
                "amp8: the optimizer checkpoint holds torch.Generator states for stochastic "
                "rounding, from an amp8 before counter-based rounding; they are ignored and "
                f"rounding continues from seed {self.seed}, so the resumed run rounds with "
                "other random bits than the saved one would have (with the same statistics)",
                stacklevel=2,
            )

    def _convert(self, param: nn.Parameter, param_state: dict[str, Any]) -> set[str]:
        """Re-store moments and master weights saved at other precisions; the names of
        what was converted."""
        converted = set()
        for key in _MOMENTS:
            wanted = self._precision(key)
            if key in param_state and state_storage.stored_precision(param_state, key) is not wanted:
                value = state_storage.load(param_state, key)
                self._store_moment(param, param_state, key, value)
                converted.add(key)
        wants_master = self.level.master_weight is not None and param in self.weights
        if wants_master and _MASTER not in param_state:
            self._store_master(param_state, self._own_chunk(param, self.weights[param].read()))
            converted.add("master weights")
        elif not wants_master and _MASTER in param_state:
            handle = self.weights.get(param)
            master = state_storage.load(param_state, _MASTER)
            del param_state[_MASTER], param_state[_MASTER + state_storage.SCALE_SUFFIX]
            if handle is not None:
                handle.write(master)
            converted.add("master weights")
        return converted


def _ready(grad_ready: Callable[[nn.Parameter], None], param: nn.Parameter, _weight: nn.Parameter) -> None:
    grad_ready(param)


def _stored(
    param_state: dict[str, Any], key: str
) -> tuple[torch.Tensor, torch.Tensor | None, fused_step.Storage | None]:
    """``(data, scales, storage)`` of ``param_state[key]`` as the fused step reads it."""
    data = param_state[key]
    scale = param_state.get(key + state_storage.SCALE_SUFFIX)
    return data, scale, _scale_storage(data, scale, param_state.get(key + state_storage.BLOCK_SUFFIX, 0))


def _scale_storage(data: torch.Tensor, scale: torch.Tensor | None, block_size: int) -> fused_step.Storage | None:
    """The fused step's ``Storage`` for ``data`` with ``scale``; None for a layout it
    does not cover (it then takes the reference step)."""
    if scale is None:
        return fused_step.Storage() if data.dtype == torch.float32 else None
    if scale.dim() == 0:
        return fused_step.Storage(data.dtype)
    if scale.dim() == 1:
        return fused_step.Storage(data.dtype, block_size=block_size) if block_size > 0 else None
    if scale.dim() == data.dim() == 2:
        rows, cols = data.shape
        if tuple(scale.shape) == (rows, 1):
            return fused_step.Storage(data.dtype, rows=True)
        if block_size > 0 and tuple(scale.shape) == (-(-rows // block_size), -(-cols // block_size)):
            return fused_step.Storage(data.dtype, tile=block_size)
    return None


def _fp8_weight_storage(handle: StoredWeight) -> tuple[fused_step.Storage | None, bool]:
    """The fused step's ``Storage`` of an FP8 weight and whether its current scales have
    the shape of new ones (``StoredWeight.encode`` then falls back to them)."""
    rows, cols = handle.param.shape
    tile = handle.tile()
    if tile is None:
        storage, shape = fused_step.Storage(E4M3), ()
    elif tile == (1, cols):
        storage, shape = fused_step.Storage(E4M3, rows=True), (rows, 1)
    elif tile[0] == tile[1]:
        storage, shape = fused_step.Storage(E4M3, tile=tile[0]), (-(-rows // tile[0]), -(-cols // tile[0]))
    else:
        return None, False
    if handle.dtype != E4M3:
        return None, False
    return storage, tuple(handle.scale.shape) == shape


def _merge_string_ids(state: dict[Any, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per-parameter state keyed by int id. torch.distributed.checkpoint loads tensors in
    place under the int ids and the other values under the ids as strings; merge both."""
    merged: dict[int, dict[str, Any]] = {}
    for param_id, saved in sorted(state.items(), key=lambda item: isinstance(item[0], int)):
        merged.setdefault(int(param_id), {}).update(saved)
    return merged


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Refuse what ``torch.optim.Adam`` refuses, with the allowed range."""
    problems = []
    if not lr >= 0:
        problems.append(f"lr={lr!r} (use lr >= 0)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        problems.append(f"betas={betas!r} (use two values in [0, 1))")
    if not eps >= 0:
        problems.append(f"eps={eps!r} (use eps >= 0)")
    if not weight_decay >= 0:
        problems.append(f"weight_decay={weight_decay!r} (use weight_decay >= 0)")
    if problems:
        raise ValueError(f"LowBitAdam: invalid {'; '.join(problems)}")


# Options of torch's Adam that LowBitAdam has no use for (implementation choices).
_TORCH_ONLY_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "amsgrad"})
_STATE_PRECISIONS = {"exp_avg": (Precision.FP32, Precision.FP8), "exp_avg_sq": (Precision.FP32, Precision.FP16)}


def check_state_precision(level: OptLevel) -> None:
    """Raise ``ValueError`` if ``level`` asks for Adam state storage amp8 does not have."""
    for key, allowed in _STATE_PRECISIONS.items():
        if getattr(level, key) not in allowed:
            raise ValueError(
                f"opt level {level.name} stores {key} as {getattr(level, key).value}; amp8 "
                f"stores it as one of {[p.value for p in allowed]}"
            )


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise if amp8 cannot take over ``optimizer`` (see ``LowBitAdam.from_optimizer``)."""
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        names = ", ".join(f"torch.optim.{cls.__name__}" for cls in SUPPORTED_OPTIMIZERS)
        cls = type(optimizer)
        module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
        raise TypeError(
            f"amp8 cannot take over {module}.{cls.__qualname__}; "
            f"it supports {names}. Build one of those and pass it to amp8.initialize."
        )
    for index, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "differentiable"):
            if group.get(option, False):
                raise ValueError(
                    f"{option}=True (param group {index}) is not supported by amp8's low-bit "
                    f"Adam; build the optimizer with {option}=False"
                )
    if optimizer.state:
        raise ValueError(
            "the optimizer has already taken steps (it holds state); call amp8.initialize "
            "before the first optimizer.step()"
        )
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        raise ValueError(
            "a learning-rate scheduler is already attached to this optimizer; create the "
            "scheduler after amp8.initialize, on the optimizer that initialize returns"
        )
