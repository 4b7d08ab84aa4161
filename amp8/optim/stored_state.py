"""How ``LowBitAdam`` stores each parameter's state and writes its weight, at the
precisions of one opt level: Adam's moments (``amp8.optim.state`` codecs), O3's FP16
master weights, and the weight itself through its ``amp8.tensor.StoredWeight`` (FP16 with
stochastic rounding, or FP8). The noise of every stochastic rounding is counted here."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import increment_version

from amp8.config.levels import OptLevel, Precision
from amp8.optim import state as state_storage
from amp8.optim.state import MASTER, MOMENTS
from amp8.optim.arithmetic import unless_skipped
from amp8.quant import noise
from amp8.quant.codec import Layout
from amp8.tensor.scaled import local_tensor
from amp8.tensor.stored import StoredWeight
from amp8.tensor.stored_layout import FP16_LAYOUT, encode_fp16


class StoredState:
    """The storage side of ``LowBitAdam``.

    Args:
        level: the opt level whose ``exp_avg``, ``exp_avg_sq`` and ``master_weight``
            columns set the precisions.
        weights: the FP8 layers' weights and their handles.
        state_block_size: elements per scale of low-bit moments (0: one per tensor).
        seed: the stochastic-rounding seed.
        own_chunk: the part of a full-size value whose state this rank keeps (all of it,
            or a sharded weight's rows).
        is_sharded: whether this rank keeps only some rows of a parameter's state.
    """

    def __init__(
        self,
        level: OptLevel,
        weights: dict[nn.Parameter, StoredWeight],
        state_block_size: int,
        seed: int,
        own_chunk: Callable[[nn.Parameter, torch.Tensor], torch.Tensor],
        is_sharded: Callable[[nn.Parameter], bool],
    ) -> None:
        self.level = level
        self.weights = weights
        self.state_block_size = state_block_size
        self.seed = seed
        self.rounding_counter = 0  # stochastic-rounding draws so far
        self._own_chunk = own_chunk
        self._is_sharded = is_sharded
        # The state of each weight whose master weight this optimizer keeps, by Parameter:
        # where a value written to the weight from outside goes (see ``attach_master``).
        self._master_states: dict[nn.Parameter, dict[str, Any]] = {}
        # Weights loaded from a plain state dict since the last step (``StoredWeight.note_plain_load``).
        self.plain_loads: list[str] = []
        for handle in weights.values():
            handle.attach_load_log(self.plain_loads)

    def next_noise_key(self) -> int:
        """The noise key of the next stochastic rounding, counting the draw."""
        key = noise.rounding_key(self.seed, self.rounding_counter)
        self.rounding_counter += 1
        return key

    def init(self, param: nn.Parameter, param_state: dict[str, Any], master_weight: torch.Tensor | None) -> None:
        """Step 0, zero moments at the level's precisions, and the master weight (from
        ``master_weight``, else from the stored weight)."""
        handle = self.weights.get(param)
        if handle is not None and self.wants_master(param):
            real = master_weight if master_weight is not None else handle.read()
            self.store_master(param_state, self._own_chunk(param, real))
            self.attach_master(param, param_state)
        shape_source = param_state.get(MASTER, param)
        param_state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        for key in MOMENTS:
            zeros = torch.zeros(shape_source.shape, dtype=torch.float32, device=param.device)
            self.store_moment(param, param_state, key, zeros)

    def wants_master(self, param: nn.Parameter) -> bool:
        """Whether the level keeps a master weight of ``param``: an FP8 layer's weight at
        a level with master weights (a low-bit table keeps its fixed FP16 storage)."""
        handle = self.weights.get(param)
        return self.level.master_weight is not None and handle is not None and not handle.fixed_storage

    def store_master(
        self, param_state: dict[str, Any], value: torch.Tensor, words: torch.Tensor | None = None,
        scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
    ) -> None:
        """Store a master weight as FP16 weights are stored (``FP16_LAYOUT``), rounded
        stochastically under ``words`` where given, with ``scale`` where given; nothing
        changes where ``skip`` is set."""
        key, scale_key = MASTER, MASTER + state_storage.SCALE_SUFFIX
        previous = param_state.get(scale_key)
        data, new_scale = FP16_LAYOUT.encode(value, scale, words, previous=previous)
        if skip is not None and key in param_state:
            data = unless_skipped(skip, param_state[key], data)
            new_scale = unless_skipped(skip, param_state[scale_key], new_scale)
        state_storage.put(param_state, key, data, new_scale, FP16_LAYOUT)

    def attach_master(self, param: nn.Parameter, param_state: dict[str, Any]) -> None:
        """Make ``param_state``'s master weight part of ``param``'s stored weight, so that
        every write of the weight from outside the optimizer (``load_state_dict``,
        ``copy_``, ``torch.nn.init``) lands in the master too and the next step starts
        from it (``StoredWeight.attach_master``). The weight holds this optimizer weakly."""
        self._master_states[param] = param_state
        self.weights[param].attach_master(_MasterWriter(self, param))

    def write_master(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Store float32 ``value`` (the whole weight) as ``param``'s master weight, in the
        memory the master holds (an update group's view stays valid)."""
        param_state = self._master_states.get(param)
        if param_state is None or MASTER not in param_state:
            return
        # Rounded to nearest: a written value is no update whose small steps need noise.
        data, scale = encode_fp16(
            self._own_chunk(param, value.float()), previous=param_state.get(MASTER + state_storage.SCALE_SUFFIX)
        )
        param_state[MASTER + state_storage.LAYOUT_SUFFIX] = FP16_LAYOUT.to_state()
        with torch.no_grad():
            for key, new in ((MASTER, data), (MASTER + state_storage.SCALE_SUFFIX, scale)):
                current = param_state[key]
                if current.shape == new.shape and current.dtype == new.dtype:
                    current.copy_(new)
                    # (a write from a weight's dispatch runs below autograd, which counts no version)
                    increment_version(current)
                else:
                    param_state[key] = new

    def update_noise_key(self, param: nn.Parameter) -> int | None:
        """The noise key of one update of ``param``: the next draw where the update rounds
        anything stochastically (an FP16 or FP8 layer's weight or master weight, an FP8
        first moment), else None (no draw)."""
        rounds = param in self.weights or state_storage.rounds_stochastically(MOMENTS[0], self.level.exp_avg)
        return self.next_noise_key() if rounds else None

    def moment_layout(self, param: nn.Parameter, key: str) -> Layout:
        """The layout ``param``'s moment ``key`` is stored at. Both moments of a matrix
        take the same scale tiles: those of its FP8 layer's weight scales (rowwise or block
        recipes), or one scale per row for any other matrix (an embedding: a rare token's
        row would round to zero under a scale set by the frequent ones). The second moment
        must not be coarser than the first: where one scale spans rows whose values lie far
        apart, the FP16 second moment flushes the small rows to zero while the first moment
        keeps them, and ``m / sqrt(v)`` moves a weight by thousands of learning rates.
        Other low-bit moments take ``state_block_size``. Scales of tiles are kept as
        ``StoredWeight.state_scale_dtype`` gives them."""
        handle = self.weights.get(param)
        shape = tuple(local_tensor(param).shape) if handle is None or not handle.sharded else (-1,)
        if handle is not None:
            tile, scale_dtype = handle.state_tile(), handle.state_scale_dtype()
        else:
            tile = (1, param.shape[1]) if param.dim() == 2 and param.numel() else None
            scale_dtype = torch.float32
        return state_storage.moment_layout(key, getattr(self.level, key), self.state_block_size, shape, tile,
                                           scale_dtype)

    def store_moment(
        self, param: nn.Parameter, param_state: dict[str, Any], key: str, value: torch.Tensor,
        words: torch.Tensor | None = None, scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
    ) -> None:
        """Store a moment at its ``moment_layout``: an FP8 first moment rounded
        stochastically under ``words`` (the update's) where given; with ``scale`` where
        given; nothing changes where ``skip`` is set."""
        layout = self.moment_layout(param, key)
        data, scales = layout.encode(value, scale, words)
        if skip is not None and key in param_state:
            data = unless_skipped(skip, param_state[key], data)
            if scales is not None:
                scales = unless_skipped(skip, param_state[key + state_storage.SCALE_SUFFIX], scales)
        state_storage.put(param_state, key, data, scales, layout)

    def weight(self, param: nn.Parameter, param_state: dict[str, Any]) -> torch.Tensor:
        """The real float32 values the update starts from: the master weight (this rank's
        rows where sharded), else what the model stores."""
        if MASTER in param_state:
            return state_storage.load(param_state, MASTER)
        handle = self.weights.get(param)
        return handle.read() if handle is not None else param.detach().float()

    def write_weight(
        self, param: nn.Parameter, param_state: dict[str, Any], value: torch.Tensor,
        words: torch.Tensor | None = None, bound: torch.Tensor | None = None, skip: torch.Tensor | None = None,
        fp8_bound: torch.Tensor | None = None,
    ) -> None:
        """Store float32 ``value`` as ``param``'s new weight: its master weight and FP8
        storage (O3; a sharded weight's FP8 rows are stored after the step, from the amax
        of all ranks), its FP16 storage (O1, O2), or the parameter itself. FP16 rounds
        stochastically under ``words`` where given (else under a new draw); a per-tensor
        scale comes from ``bound`` (a bound on the new amax) where given, and O3's FP8
        weight's scales from ``fp8_bound`` (bounds in the shape of its scales) where given;
        nothing changes where ``skip`` is set."""
        handle = self.weights.get(param)
        if words is None and handle is not None:
            words = noise.update_words(noise.element_index(value.shape, value.device), self.next_noise_key())
        if MASTER in param_state:
            master_scale = self._bound_scale(FP16_LAYOUT, bound, param_state[MASTER + state_storage.SCALE_SUFFIX])
            self.store_master(param_state, value, words, master_scale, skip)
            if not self._is_sharded(param):  # the FP8 weight, from the master as stored
                assert handle is not None
                master = state_storage.load(param_state, MASTER)
                fp8_scale = self._bound_scale(handle.layout, bound if fp8_bound is None else fp8_bound, handle.scale)
                self._store_handle(handle, master, None, fp8_scale, skip)
        elif handle is not None:
            self._store_handle(handle, value, words, self._bound_scale(handle.layout, bound, handle.scale), skip)
        else:
            param.copy_(unless_skipped(skip, param, value))

    @staticmethod
    def _bound_scale(layout: Layout, bound: torch.Tensor | None, previous: torch.Tensor) -> torch.Tensor | None:
        """The scales ``layout`` takes from ``bound``, per tensor, or per row or block
        where ``bound`` has their shape; None (scales from the values) for other tilings
        or without a bound."""
        if bound is None or not (layout.per_tensor or (layout.per_row and bound.dim() > 0)):
            return None
        return layout.scales(bound, previous.float() if previous.shape == bound.shape else None)

    @staticmethod
    def _store_handle(
        handle: StoredWeight, value: torch.Tensor, words: torch.Tensor | None, scale: torch.Tensor | None,
        skip: torch.Tensor | None,
    ) -> None:
        """Encode ``value`` into ``handle``'s storage, unless ``skip``."""
        data, new_scale = handle.encode(value, words, scale=scale)
        if skip is not None:
            data = unless_skipped(skip, handle.data, data)
            new_scale = unless_skipped(skip, handle.scale, new_scale) if handle.scale.shape == new_scale.shape \
                else new_scale
        handle.store_from_master(data, new_scale)

    def convert(self, param: nn.Parameter, param_state: dict[str, Any]) -> set[str]:
        """Re-store moments and master weights saved at other precisions (another opt
        level); the names of what was converted."""
        converted = set()
        for key in MOMENTS:
            wanted: Precision = getattr(self.level, key)
            if key in param_state and state_storage.stored_precision(param_state, key) is not wanted:
                self.store_moment(param, param_state, key, state_storage.load(param_state, key))
                converted.add(key)
        if self.wants_master(param):
            if MASTER not in param_state:
                self.store_master(param_state, self._own_chunk(param, self.weights[param].read()))
                converted.add("master weights")
            self.attach_master(param, param_state)
        elif MASTER in param_state:
            handle = self.weights.get(param)
            master = state_storage.load(param_state, MASTER)
            for suffix in ("", state_storage.SCALE_SUFFIX, state_storage.LAYOUT_SUFFIX):
                param_state.pop(MASTER + suffix, None)
            if handle is not None:
                handle.write(master)
            converted.add("master weights")
        return converted

    def store_sharded_weights(
        self,
        state: dict[nn.Parameter, dict[str, Any]],
        max_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Each rank's rows of every sharded weight, cast from its master rows to FP8 with
        the whole weight's scales (one per weight, or per expert of a stack of experts,
        from the amaxes over all ranks), stored in place; FSDP2 all-gathers them before
        the next forward. Runs under ``no_grad``."""
        params = [p for p in self.weights if MASTER in state[p]]
        if not params:
            return
        rows = [state_storage.load(state[p], MASTER).view(local_tensor(p).shape) for p in params]
        local_amaxes = [self.weights[p].amax_of_rows(chunk) for p, chunk in zip(params, rows)]
        amaxes = max_over_ranks(torch.cat([amax.flatten() for amax in local_amaxes]))
        for param, chunk, local, amax in zip(params, rows, local_amaxes, amaxes.split([a.numel() for a in local_amaxes])):
            handle = self.weights[param]
            handle.store_from_master(*handle.encode(chunk, amax_value=amax.view(local.shape)))


class _MasterWriter:
    """What an O3 weight calls with each value written to it from outside the optimizer
    (``StoredWeight.attach_master``): the optimizer's ``write_master``, while the
    optimizer lives (held weakly: a model does not keep its optimizer's state alive; the
    Parameter is held strongly, as torch cannot swap a tensor that a weak reference
    points at)."""

    def __init__(self, stored: StoredState, param: nn.Parameter) -> None:
        self._stored = weakref.ref(stored)
        self._param = param

    def __call__(self, value: torch.Tensor) -> None:
        stored = self._stored()
        if stored is not None:
            stored.write_master(self._param, value)
