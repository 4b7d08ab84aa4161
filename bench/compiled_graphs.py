"""Calls of ``torch.compile``d graphs, watched from the Python side: how many run, the
bytes each reads and writes, and the kernels each launches.

A compiled graph's kernels run as generated code (C++ on the CPU) that no
``TorchDispatchMode`` sees, so ``GraphCalls`` watches the one Python call every inductor
graph goes through (``CompiledFxGraph.__call__``) with ``sys.setprofile``. Whatever calls
the graphs (one per parameter, one per flat buffer of many parameters, anything else)
is counted as it runs, with nothing assumed about the caller. Per call:
- bytes: the nbytes of its tensor inputs (read) and outputs (written), plus the inputs
  the graph writes in place (``mutated_input_idxs``), written again;
- kernels: the kernels it would launch on a GPU, read from the source inductor generated
  for this device (``kernel_launches``: the loop nests of the kernels it calls, plus
  ``extern_kernels`` calls such as GEMMs and the aten operations it falls back to);
- kernel bytes: the nbytes of every tensor argument of each generated kernel it calls
  (``kernel_bytes``), inputs and the buffers it allocates alike, so an intermediate that
  one kernel writes and the next reads is counted twice, as a GPU moves it; for a graph
  with symbolic sizes, its inputs, outputs and in-place writes. The
  ``extern_kernels`` and fallback calls are aten operations that a ``TorchDispatchMode``
  sees: their bytes and FLOPs are for the caller to count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys
from types import FrameType
from typing import Any, Callable

import torch
from torch._inductor.output_code import CompiledFxGraph

_GRAPH_CALL = CompiledFxGraph.__call__.__code__
_KERNEL_DEFINITION = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.\w+\(")
_OUTER_LOOP = re.compile(r"for\(int64_t x0=")  # inductor's C++ names the outermost index x0
_FALLBACK_CALL = re.compile(r"\btorch\.ops\.\w+\.\w+\.\w+\(")  # an aten (or custom) op the graph falls back to
_UNPACK = re.compile(r"^\s+([\w, ]+) = args$", re.MULTILINE)
_SYMBOL = re.compile(r"^\s+(k?s\d+) = (.+)$", re.MULTILINE)
_BUFFER = re.compile(r"^\s+(\w+) = empty_strided_\w+\((\(.*?\)), \(.*?\), torch\.(\w+)\)", re.MULTILINE)
_REUSE = re.compile(r"^\s+(\w+) = (\w+); del \2\s+# reuse", re.MULTILINE)
_SIGNATURE = re.compile(r"\bkernel\((.*?)\)\s*\{", re.DOTALL)
_POINTER = re.compile(r"\b((?:in_out|in|out)_ptr\d+)\b")
_POINTER_ALIAS = re.compile(r"auto (\w+) = (\w+);")


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call of a compiled graph."""

    read_bytes: int  # tensor inputs
    written_bytes: int  # tensor outputs and inputs written in place
    kernels: int  # kernels its generated code launches
    kernel_bytes: int = 0  # tensor arguments of its generated kernels (not its extern calls); see GraphCalls


@functools.lru_cache(maxsize=None)
def kernel_launches(source_code: str) -> int:
    """GPU kernels one call of inductor's generated ``source_code`` stands for: each call
    of a kernel it defines counts one launch per outermost loop nest in that kernel's C++
    (the CPU backend puts several of the scheduler's fused nodes, each its own loop nest
    and its own kernel on the GPU, in one function), plus each ``extern_kernels`` call."""
    definitions = list(_KERNEL_DEFINITION.finditer(source_code))
    call_at = source_code.find("def call(")
    body = source_code[call_at:] if call_at >= 0 else source_code
    launches = len(_EXTERN_CALL.findall(body)) + len(_FALLBACK_CALL.findall(body))
    for i, definition in enumerate(definitions):
        end = definitions[i + 1].start() if i + 1 < len(definitions) else call_at
        nests = max(1, len(_OUTER_LOOP.findall(source_code, definition.end(), end)))
        calls = len(re.findall(rf"\b{re.escape(definition.group(1))}(?:\.run)?\(", body))
        launches += calls * nests
    return launches


@dataclasses.dataclass(frozen=True)
class _CallPlan:
    """What ``kernel_bytes`` reads from a graph's ``call``: names bound to its arguments,
    size symbols, allocated buffers, reused buffers, and each generated kernel call's arguments."""

    inputs: tuple[str, ...]
    symbols: tuple[tuple[str, str], ...]  # (name, expression)
    buffers: tuple[tuple[str, str, str], ...]  # (name, size expression, dtype name)
    aliases: tuple[tuple[str, str], ...]  # (new name, reused buffer)
    kernel_args: tuple[tuple[str, ...], ...]
    nest_args: tuple[tuple[tuple[int, ...], ...], ...]  # per kernel call: the argument positions each loop nest reads or writes


@functools.lru_cache(maxsize=None)
def _call_plan(source_code: str) -> _CallPlan:
    call_at = source_code.find("def call(")
    body = source_code[call_at:] if call_at >= 0 else ""
    unpack = _UNPACK.search(body)
    definitions = list(_KERNEL_DEFINITION.finditer(source_code))
    kernel_args, nest_args = [], []
    for i, definition in enumerate(definitions):
        name = definition.group(1)
        end = definitions[i + 1].start() if i + 1 < len(definitions) else (call_at if call_at >= 0 else len(source_code))
        nests = _nests(source_code[definition.end():end])
        for match in re.finditer(rf"\b{re.escape(name)}(?:\.run)?\((.*)\)$", body, re.MULTILINE):
            args = re.sub(r"reinterpret_tensor\((\w+),[^)]*\)[^,]*", r"\1", match.group(1))
            kernel_args.append(tuple(arg.strip() for arg in args.split(",")))
            nest_args.append(nests or (tuple(range(len(kernel_args[-1]))),))
    return _CallPlan(
        inputs=tuple(name.strip() for name in unpack.group(1).split(",")) if unpack else (),
        symbols=tuple((m.group(1), m.group(2)) for m in _SYMBOL.finditer(body)),
        buffers=tuple(m.groups() for m in _BUFFER.finditer(body)),
        aliases=tuple(m.groups() for m in _REUSE.finditer(body)),
        kernel_args=tuple(kernel_args),
        nest_args=tuple(nest_args),
    )


def _nests(kernel_source: str) -> tuple[tuple[int, ...], ...]:
    """The positions of the arguments each outermost loop nest of a generated C++ kernel
    reads or writes (each nest is a kernel of its own on a GPU); empty where the source
    has no signature or no nest."""
    signature = _SIGNATURE.search(kernel_source)
    if signature is None:
        return ()
    params = [param.strip().split()[-1].lstrip("*") for param in signature.group(1).split(",")]
    position = {param: i for i, param in enumerate(params)}
    alias = dict(_POINTER_ALIAS.findall(kernel_source))
    starts = [m.start() for m in _OUTER_LOOP.finditer(kernel_source)]
    nests = []
    for start, stop in zip(starts, starts[1:] + [len(kernel_source)]):
        used = {alias.get(p, p) for p in _POINTER.findall(kernel_source, start, stop)}
        nests.append(tuple(sorted(position[p] for p in used if p in position)))
    return tuple(nests)


def kernel_bytes(source_code: str, inputs: list[Any]) -> int:
    """Bytes the generated kernels of one call of ``source_code`` with ``inputs`` (the
    graph's arguments) move: each kernel call's tensor arguments, counted once per call
    (a kernel reads or writes each at least once). Sizes of buffers that depend on the
    call's shapes are evaluated from its symbolic sizes; an argument that cannot be sized is left out."""
    plan = _call_plan(source_code)
    env: dict[str, Any] = dict(zip(plan.inputs, inputs))
    for name, expression in plan.symbols:
        with contextlib.suppress(Exception):  # an expression that is not plain arithmetic sizes nothing
            env[name] = eval(expression, {"__builtins__": {}}, env)  # noqa: S307 (inductor's own source)
    nbytes = {name: value.nbytes for name, value in env.items() if isinstance(value, torch.Tensor)}
    for name, size, dtype in plan.buffers:
        with contextlib.suppress(Exception):
            shape = eval(size, {"__builtins__": {}}, env)  # noqa: S307
            nbytes[name] = int(math.prod(shape)) * getattr(torch, dtype).itemsize
    for name, reused in plan.aliases:
        if reused in nbytes:
            nbytes[name] = nbytes[reused]
    return sum(nbytes.get(args[i], 0) for args, nests in zip(plan.kernel_args, plan.nest_args, strict=True)
               for nest in nests for i in nest)


def _tensor_bytes(values: Any) -> list[int]:
    return [value.nbytes if isinstance(value, torch.Tensor) else 0 for value in values]


class GraphCalls:
    """``with GraphCalls(on_call):`` calls ``on_call(GraphCall)`` after each compiled graph
    call inside the block; ``inside`` is True while one runs (anything dispatched then
    belongs to the graph). Restores the previous ``sys.setprofile`` function on exit."""

    def __init__(self, on_call: Callable[[GraphCall], None]) -> None:
        self.on_call = on_call
        self.inside = 0
        self._pending: list[tuple[list[int], int, int, int | None]] = []
        self._previous: Any = None

    def __enter__(self) -> "GraphCalls":
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if frame.f_code is not _GRAPH_CALL:
            return
        graph = frame.f_locals["self"]
        if event == "call":
            # The generated code empties its argument list: size the inputs now.
            arguments = list(frame.f_locals["inputs"])
            inputs = _tensor_bytes(arguments)
            mutated = sum(inputs[i] for i in graph.mutated_input_idxs)
            # A graph with symbolic sizes (the optimizer's, compiled with dynamic shapes) is
            # sized by its inputs and outputs: the sizes of its buffers, evaluated from its
            # symbols, varied between compilations of the same graph.
            static = not _call_plan(graph.source_code).symbols
            moved = kernel_bytes(graph.source_code, arguments) if static else None
            self._pending.append((inputs, mutated, kernel_launches(graph.source_code), moved))
            self.inside += 1
        elif event == "return" and self._pending:
            inputs, mutated, kernels, moved = self._pending.pop()
            self.inside -= 1
            outputs = sum(_tensor_bytes(arg)) if isinstance(arg, (list, tuple)) else 0
            moved = sum(inputs) + outputs + mutated if moved is None else moved
            self.on_call(GraphCall(sum(inputs), outputs + mutated, kernels, moved))
