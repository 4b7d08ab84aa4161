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
  ``extern_kernels`` calls such as GEMMs).
"""

from __future__ import annotations

import dataclasses
import functools
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


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call of a compiled graph."""

    read_bytes: int  # tensor inputs
    written_bytes: int  # tensor outputs and inputs written in place
    kernels: int  # kernels its generated code launches


@functools.lru_cache(maxsize=None)
def kernel_launches(source_code: str) -> int:
    """GPU kernels one call of inductor's generated ``source_code`` stands for: each call
    of a kernel it defines counts one launch per outermost loop nest in that kernel's C++
    (the CPU backend puts several of the scheduler's fused nodes, each its own loop nest
    and its own kernel on the GPU, in one function), plus each ``extern_kernels`` call."""
    definitions = list(_KERNEL_DEFINITION.finditer(source_code))
    call_at = source_code.find("def call(")
    body = source_code[call_at:] if call_at >= 0 else source_code
    launches = len(_EXTERN_CALL.findall(body))
    for i, definition in enumerate(definitions):
        end = definitions[i + 1].start() if i + 1 < len(definitions) else call_at
        nests = max(1, len(_OUTER_LOOP.findall(source_code, definition.end(), end)))
        calls = len(re.findall(rf"\b{re.escape(definition.group(1))}(?:\.run)?\(", body))
        launches += calls * nests
    return launches


def _tensor_bytes(values: Any) -> list[int]:
    return [value.nbytes if isinstance(value, torch.Tensor) else 0 for value in values]


class GraphCalls:
    """``with GraphCalls(on_call):`` calls ``on_call(GraphCall)`` after each compiled graph
    call inside the block; ``inside`` is True while one runs (anything dispatched then
    belongs to the graph). Restores the previous ``sys.setprofile`` function on exit."""

    def __init__(self, on_call: Callable[[GraphCall], None]) -> None:
        self.on_call = on_call
        self.inside = 0
        self._pending: list[tuple[list[int], int, int]] = []
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
            inputs = _tensor_bytes(frame.f_locals["inputs"])
            mutated = sum(inputs[i] for i in graph.mutated_input_idxs)
            self._pending.append((inputs, mutated, kernel_launches(graph.source_code)))
            self.inside += 1
        elif event == "return" and self._pending:
            inputs, mutated, kernels = self._pending.pop()
            self.inside -= 1
            outputs = sum(_tensor_bytes(arg)) if isinstance(arg, (list, tuple)) else 0
            self.on_call(GraphCall(sum(inputs), outputs + mutated, kernels))
