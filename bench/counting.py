"""What a step dispatches, counted on the CPU as a proxy for what it costs on a GPU:
``StepCounter``, a ``TorchDispatchMode`` that counts per phase (``with counter.phase(name)``)
and, inside amp8's optimizer step, per part (``OPTIMIZER_PARTS``):
- ops: aten operations that run a kernel (views, ``detach`` and allocations are left out),
  a proxy for GPU kernel launches in eager mode; host ops: operations on tensors a CUDA
  run keeps on the CPU (the optimizer's step counts) and on what is computed from them
  alone; syncs: ``.item()``-style reads of anything else (a read of a host tensor is
  none); each phase is also counted in stretches between its syncs (``stretches``);
- bytes: the nbytes of every plain tensor an operation takes plus those it returns, an
  upper bound of its memory traffic (a kernel may read a broadcast operand once, and an
  in-place result is counted as read and written);
- GEMM FLOPs from ``torch.utils.flop_counter``'s formulas: ``_scaled_mm`` as FP8, the
  rest (mm, addmm, bmm, attention) as high precision;
- graph calls: calls of compiled graphs, each with the GPU kernels its generated code
  stands for and the bytes those kernels' arguments hold (``compiled_graphs.GraphCalls``);
  the GEMMs and fallbacks a graph calls (``extern_kernels``) are aten operations this mode
  sees: their bytes and FLOPs go to the graph's counts;
- int ops: element operations on int32 and int64 tensors (the stochastic rounding's hash).
A compiled backward's ``amp8.weight_grad_parts`` (an FP8 weight gradient written into its
optimizer slot) runs its quantization compiled, as on CUDA, and counts as that graph call.
Besides, ``dispatched`` counts every aten operation dispatched while the counter is
active, in a phase or not, a compiled graph's call as one (``dispatched_operations``):
what must not grow with the number of parameters.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from amp8.tensor.weight_grad import weight_grad_parts
from compiled_graphs import GraphCall, GraphCalls

aten = torch.ops.aten
PHASES = ("forward", "backward", "optimizer")
# amp8 functions (qualified names) whose operations make up a part of the optimizer step;
# the innermost one on the stack names the part, anything else is "update".
OPTIMIZER_PARTS = {
    "all_finite": "finite check",
    "UpdateGroup.gather": "gradient copy",
    "LowBitAdam.gradient": "gradient read",
    "StoredState.weight": "weight read",
    "adam_group_step": "update",
    "step_scalars": "step coefficients",
    "keep_amaxes": "amaxes kept",
    "StoredState.store_moment": "moment store",
    "UpdateGroup.run": "weight store",  # the plain weights copied back, the layers' casts dropped
    "StoredState.write_weight": "weight store",
    "plain_adam_step": "plain step",
}
# Operations that launch no kernel: allocations and metadata (views are found by schema).
NO_KERNEL = {aten.detach.default, aten.empty.memory_format, aten.empty_strided.default, aten.lift_fresh.default,
             aten._unsafe_view.default}  # a view its schema does not mark as one
# Operations that overwrite their first argument without reading it: it counts as written only.
OVERWRITE = {aten.copy_.default, aten.fill_.Scalar, aten.zero_.default}
SYNC = {aten._local_scalar_dense.default, aten.is_nonzero.default}
# amp8's FP8 weight gradient written into its slot from a compiled backward: no kernel of
# its own; its quantization runs as the compiled kernels CUDA runs, counted as a graph call.
WEIGHT_GRAD_PARTS = weight_grad_parts._opoverload  # torch.ops.amp8.weight_grad_parts.default
COUNTS = ("ops", "host_ops", "syncs", "bytes", "fp8_flops", "other_flops", "graph_calls", "graph_kernels", "graph_bytes",
          "int_ops")
INTEGER = (torch.int32, torch.int64)  # dtypes whose element operations count as int_ops


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(FP8 FLOPs, other GEMM FLOPs) of one operation."""
    packet = func._overloadpacket
    if packet is torch.ops.amp8.emulated_scaled_mm:  # rowwise FP8 GEMMs on a torch without them on the CPU
        return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1], 0
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return 0, flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return 0, flop_counter.sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
    if packet not in flop_counter.flop_registry:
        return 0, 0
    flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
    return (flops, 0) if packet is aten._scaled_mm else (0, flops)


def _optimizer_part() -> str:
    """The part of amp8's optimizer step the running operation belongs to."""
    frame = sys._getframe(2)
    while frame is not None:
        part = OPTIMIZER_PARTS.get(frame.f_code.co_qualname)
        if part is not None:
            return part
        frame = frame.f_back
    return "update"


def _order(name: str) -> tuple[int, bool]:
    """A phase's row, then its parts (``sorted`` keeps their order of first run); a phase
    of the caller's own after the step's."""
    phase = name.split(":")[0]
    return PHASES.index(phase) if phase in PHASES else len(PHASES), name != phase


class StepCounter(TorchDispatchMode):
    """Counts ops, syncs, bytes and GEMM FLOPs per phase (``with counter.phase(name)``),
    and the compiled-graph calls, their kernels and bytes (``compiled_graphs.GraphCalls``);
    ``dispatched`` counts every operation dispatched while active, a graph call as one."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.current = ""
        self.counts: dict[str, dict[str, float]] = {}
        self.dispatched = 0
        self._graphs = GraphCalls(self._count_graph_call)
        # Tensors that stay on the CPU in a CUDA run (``step_profile.host_scalars``) and what is computed
        # from them alone: reading one is no sync, and operating on one launches no kernel.
        self._host = WeakTensorKeyDictionary()
        for tensor in host_tensors:
            self._host[tensor] = True
        # The row whose operation produced each tensor: a sync waits for that row's work.
        self._producer = WeakTensorKeyDictionary()
        # Per phase, its counts between syncs: a sync ends a stretch (the clocks join there).
        self.stretches: dict[str, list[dict[str, float]]] = {}

    @classmethod
    def is_infra_mode(cls) -> bool:
        """True: torch.compile runs compiled code under an infra mode (it falls back to eager
        under any other), so the optimizer's compiled graphs run compiled, as in training;
        this mode then sees only the eager operations around them."""
        return True

    def __enter__(self) -> "StepCounter":
        self._graphs.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._graphs.__exit__(*exc)

    def _row_name(self) -> str:
        name = self.current
        return f"optimizer: {_optimizer_part()}" if name == "optimizer" else name

    def _row(self, name: str | None = None) -> dict[str, float]:
        return self.counts.setdefault(name or self._row_name(), dict.fromkeys(COUNTS, 0))

    def _count(self, name: str | None, **values: float) -> None:
        """Add ``values`` to row ``name`` (default: the running part) and to the phase's stretch."""
        row = self._row(name)
        stretch = self.stretches.setdefault(self.current, [dict.fromkeys(COUNTS, 0)])[-1]
        for key, value in values.items():
            row[key] += value
            stretch[key] += value

    def totals(self) -> dict[str, dict[str, float]]:
        """The counts per phase and part, each phase's row the sum of its parts' and its own;
        the parts of a phase in the order they first ran."""
        rows = {name: dict(row) for name, row in self.counts.items()}
        for name in PHASES:
            row = rows.setdefault(name, dict.fromkeys(COUNTS, 0))
            for part, counts in self.counts.items():
                if part.startswith(f"{name}: "):
                    for key in COUNTS:
                        row[key] += counts[key]
        return {name: rows[name] for name in sorted(rows, key=_order)}

    def _graph_row(self) -> str | None:
        # A compiled graph in the optimizer is its update, whichever amp8 function calls it.
        return "optimizer: update" if self.current == "optimizer" else None

    def _count_graph_call(self, call: GraphCall) -> None:
        self.dispatched += 1
        if not self.current:
            return
        self._count(self._graph_row(), graph_calls=1, graph_kernels=call.kernels, graph_bytes=call.kernel_bytes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside the block under ``name``."""
        self.current = name
        try:
            yield
        finally:
            self.current = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self._graphs.inside:
            self.dispatched += 1
        if func is WEIGHT_GRAD_PARTS:  # (its last argument: whether the quantization runs compiled)
            return func(*args[:-1], True, **kwargs)
        out = func(*args, **kwargs)
        if not self.current:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self._graphs.inside:  # an extern kernel (GEMM) or fallback of a compiled graph: its bytes and FLOPs
            unique = {id(t): t for t in inputs + outputs if type(t) in (torch.Tensor, torch.nn.Parameter)}
            fp8, other = _flops(func, args, kwargs, out)
            self._count(self._graph_row(), graph_bytes=sum(t.nbytes for t in unique.values()), fp8_flops=fp8,
                        other_flops=other)
            return out
        on_host = bool(inputs) and all(t in self._host for t in inputs)
        if func in SYNC:
            if not on_host:  # a read of a GPU value: the host waits for the work that made it
                self._count(self._producer.get(inputs[0]), syncs=1)
                self.stretches[self.current].append(dict.fromkeys(COUNTS, 0))
            return out
        name = self._row_name()
        for tensor in outputs:
            if on_host:
                self._host[tensor] = True
            else:
                self._producer[tensor] = name
        if func.is_view or func in NO_KERNEL:
            return out
        if on_host:  # arithmetic on CPU scalars: host time, no kernel
            self._count(name, host_ops=1)
            return out
        read = inputs[1:] if func in OVERWRITE else inputs
        tensors = [t for t in read + outputs if type(t) in (torch.Tensor, torch.nn.Parameter)]
        fp8, other = _flops(func, args, kwargs, out)
        integer = sum(t.numel() for t in outputs if t.dtype in INTEGER)
        self._count(name, ops=1, bytes=sum(t.nbytes for t in tensors), fp8_flops=fp8, other_flops=other,
                    int_ops=integer)
        return out


def dispatched_operations(step: Callable[[], Any]) -> int:
    """Aten operations (and compiled-graph calls) one call of ``step`` dispatches."""
    with StepCounter() as counter:
        step()
    return counter.dispatched
