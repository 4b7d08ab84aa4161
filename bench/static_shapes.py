"""Whether amp8's compiled kernels lose speed to dynamic shapes: each function amp8
compiles for itself, as amp8 compiles it and compiled for the shapes at hand.

    python bench/static_shapes.py --device cuda                  # an H200: a few minutes
    python bench/static_shapes.py --tokens 64 --width 64 --millions 1   # the CPU: the script

amp8 compiles the casts of an eager model's FP8 layers (``amp8.nn.cast_kernels``, the
weight gradient's quantization) and its optimizer's update (``amp8.optim.group_step``)
once per spec for every shape (``dynamic=True``), so that every layer, batch and group
size shares one graph. On an H200 the compiled O2 and O3 updates ran at a fifth of the
memory bandwidth O1's reached, and an eager gpt-1b with compiled casts took twice the
compiled step; a kernel compiled for symbolic sizes divides by them at run time and
cannot keep a row of unknown length in registers, so this measures what that costs.

Cases, on the same inputs:
- the casts of one FP8 linear layer's training step (the level's default recipe,
  ``--tokens`` x ``--width`` -> ``--width * --mlp``, the wider layer's input cast and
  output gradient's too), each call as ``amp8._compiled.call_compiled`` makes it,
  recorded during one forward and backward;
- the optimizer's compiled group update over ``--millions`` million parameters of
  ``--width`` x ``--width`` layers, at O1, O2 and O3.

Each row gives both variants' kernels on the device clock (the profiler's CUDA kernel
times per call, by name), and the bytes of the tensors the call is handed and returns
over that time (``moved_bytes``: each handed in read once, each written in place or
returned written once), a rate to set beside the device's bandwidth; on the CPU, wall
times.
Results go to ``--out``/static_shapes-<device>.json, rewritten after each row. With
``TORCHINDUCTOR_CACHE_DIR`` set to an empty folder, the generated code of both
variants stays there for reading (``bash bench/run_gpu.sh`` packs it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves

import amp8
import amp8._compiled
from amp8.optim import LowBitAdam
from amp8.optim.group_step import COMPILE_OPTIONS, adam_group_step
from common import free_memory, reset_compiler
from optimizer import backward_pass, square_layers
from records import RESULTS, write_result
from timing import synchronize

Call = tuple[str, Callable[..., Any], Callable[..., Any], tuple[Any, ...]]  # name, amp8's, static, args


def compile_static(function: Callable[..., Any], options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``torch.compile(function)`` for the shapes it is first called with (full graph,
    ``dynamic=False``), over a private copy of its code, as amp8 compiles its own but for
    static shapes."""
    private = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                                 function.__defaults__, function.__closure__)
    return torch.compile(private, fullgraph=True, dynamic=False, options=options)


def tensors_in(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` (nested in tuples, lists, NamedTuples), each once."""
    seen: dict[int, torch.Tensor] = {}
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def moved_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """The bytes one call ``fn(*args)`` moves, at least: each tensor it is handed read
    once, each of those it writes in place (its version moves) written once, each it
    returns written once."""
    handed = tensors_in(args)
    versions = [tensor._version for tensor in handed]
    outputs = tensors_in(fn(*args))
    written = sum(tensor.nbytes for tensor, version in zip(handed, versions) if tensor._version != version)
    handed_ids = {id(tensor) for tensor in handed}
    return sum(t.nbytes for t in handed) + written + sum(t.nbytes for t in outputs if id(t) not in handed_ids)


def device_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, dict[str, float]]:
    """Milliseconds per call of ``fn`` and its kernels by name (ms per call): the device
    clock's kernel times on CUDA, else the median wall time (no kernels)."""
    for _ in range(3):
        fn()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times), {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        synchronize(device)
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / 1e3 / repeats
    return sum(kernels.values()), dict(sorted(kernels.items(), key=lambda item: -item[1]))


def compare(name: str, dynamic: Callable[..., Any], static: Callable[..., Any], args: tuple[Any, ...],
            device: torch.device, repeats: int) -> dict[str, Any]:
    """One row: ``dynamic(*args)`` (amp8's) against ``static(*args)`` on the device clock."""
    moved = moved_bytes(dynamic, args)
    row: dict[str, Any] = {"case": name, "bytes": moved}
    for variant, fn in (("dynamic", dynamic), ("static", static)):
        ms, kernels = device_ms(lambda: fn(*args), device, repeats)
        row[variant] = {"ms": ms, "gb_per_s": moved / ms / 1e6 if ms > 0 else None, "kernels": kernels}
    row["static_speedup"] = row["dynamic"]["ms"] / row["static"]["ms"] if row["static"]["ms"] > 0 else None
    return row


def cast_case(function: Callable[..., Any], spec: Any, args: tuple[Any, ...]) -> str:
    """A name for one call of a cast amp8 compiles: the function, its input's shape, and
    for a ``CastSpec`` the dim its GEMM contracts and the layouts it writes (r, c, p); for
    several casts made in one call (a tuple of specs and of inputs), each of them."""
    specs = spec if isinstance(spec, tuple) else (spec,)
    inputs = args[0] if isinstance(args[0], tuple) else (args[0],)
    parts = []
    for one, x in zip(specs, inputs):
        contract = getattr(one, "contract_dim", None)
        layouts = "".join(name[0] for name in ("rows", "columns", "padded") if getattr(one, name, False))
        detail = "" if contract is None else f" contracting dim {contract}, layouts {layouts}"
        parts.append(f"{tuple(x.shape)}{detail}")
    return f"{function.__name__} " + "; ".join(parts)


def in_call_state(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under the grad mode and CUDA autocast of now, as it was called (an
    autograd Function's forward and backward run without grad: a compiled function
    called with grad on traces a backward too; both states are part of its guards)."""
    grad = torch.is_grad_enabled()
    autocast = torch.is_autocast_enabled("cuda")
    autocast_dtype = torch.get_autocast_dtype("cuda")

    def call(*args: Any) -> Any:
        with torch.set_grad_enabled(grad), torch.autocast("cuda", autocast_dtype, enabled=autocast):
            return fn(*args)

    return call


def recorded_casts(level: str, tokens: int, width: int, mlp: int, device: torch.device) -> list[Call]:
    """Every call amp8 compiles in one forward and backward of an eager two-layer MLP
    (``width`` -> ``width * mlp`` -> ``width``, every layer FP8, the casts compiled):
    its name, amp8's compiled function, one compiled for static shapes, and its arguments."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width * mlp), nn.GELU(), nn.Linear(width * mlp, width)).to(device)
    model, _ = amp8.initialize(model, None, level, layer_selection="all", compiled_casts=True)
    x = torch.randn(tokens, width, device=device)

    def autocast() -> contextlib.AbstractContextManager[Any]:  # BF16 on CUDA, as the gpt bench trains
        return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    with autocast():
        model(x).float().square().mean().backward()  # compiles amp8's functions
    calls: list[Call] = []
    statics: dict[Any, Callable[..., Any]] = {}
    original = amp8._compiled.compiled_for

    def recording(function: Callable[..., Any], spec: Any, variant: Any = None) -> Callable[..., Any]:
        compiled = original(function, spec, variant)

        def call(*args: Any) -> Any:
            key = (function, spec, variant, tuple(arg.shape for arg in tree_leaves(args) if isinstance(arg, torch.Tensor)))
            if key not in statics:
                statics[key] = compile_static(lambda *xs: function(spec, *xs))
            calls.append((cast_case(function, spec, args), in_call_state(compiled), in_call_state(statics[key]), args))
            return compiled(*args)

        return call

    model.zero_grad()
    with mock.patch.object(amp8._compiled, "compiled_for", recording), autocast():
        model(x).float().square().mean().backward()
    return calls


class _RecordedStep:
    """Stands in for an optimizer's compiled group update (``GroupSteps``' entry for one
    spec): runs it, and compares it once with a static compile of the same function."""

    def __init__(self, spec: Any, compiled: Callable[..., Any], device: torch.device, repeats: int) -> None:
        self.spec, self.compiled, self.device, self.repeats = spec, compiled, device, repeats
        self.row: dict[str, Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.row is None:
            spec = self.spec
            static = compile_static(lambda *xs: adam_group_step(spec, *xs), COMPILE_OPTIONS)
            self.row = compare("group update", self.compiled, static, args, self.device, self.repeats)
        return self.compiled(*args)


def optimizer_rows(millions: int, width: int, levels: list[str], device: torch.device, repeats: int) -> Iterator[dict[str, Any]]:
    """A row per level: the compiled group update of LowBitAdam (fused) over ``millions``
    million parameters of ``width`` x ``width`` FP8 layers, dynamic against static."""
    for level in levels:
        reset_compiler()
        free_memory(device)
        torch.manual_seed(0)
        model, _ = amp8.initialize(square_layers(millions, width, device), None, level, layer_selection="all")
        optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                              amp8.LEVELS[level], fused=True)
        before = backward_pass(model, optimizer, device)
        before()
        optimizer.step()  # compiles amp8's update
        steps = optimizer._group_steps[True]
        recorders = {spec: _RecordedStep(spec, compiled, device, repeats) for spec, compiled in steps._steps.items()}
        steps._steps.update(recorders)
        before()
        optimizer.step()
        for recorder in recorders.values():
            if recorder.row is not None:
                parameters = sum(p.numel() for p in model.parameters())
                yield {**recorder.row, "case": f"{level} group update", "parameters": parameters,
                       "bytes_per_parameter": recorder.row["bytes"] / parameters}
        del model, optimizer, steps, recorders


def summary(row: dict[str, Any]) -> str:
    """One line of a row."""
    dynamic, static = row["dynamic"], row["static"]
    rate = "" if dynamic["gb_per_s"] is None else \
        f" ({dynamic['gb_per_s']:.0f} against {static['gb_per_s']:.0f} GB/s)"
    return (f"{row['case']}: {row['bytes'] / 1e6:.1f} MB, dynamic {dynamic['ms']:.3f} ms, static "
            f"{static['ms']:.3f} ms{rate}, static {row['static_speedup']:.2f}x")


def main(argv: list[str] | None = None) -> Path:
    """Run the cases and write the JSON; its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--level", default="O1", choices=("O1", "O2", "O3"), help="the layer's level (casts)")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the layer's input (batch x sequence)")
    parser.add_argument("--width", type=int, default=2048, help="the model width (and the optimizer's layers')")
    parser.add_argument("--mlp", type=int, default=4, help="the wider layer's width over --width")
    parser.add_argument("--millions", type=int, default=300, help="millions of parameters in the optimizer's rows")
    parser.add_argument("--levels", nargs="+", default=["O2", "O1", "O3"], help="the optimizer's levels, in order")
    parser.add_argument("--repeats", type=int, default=10, help="calls per variant")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {
        "tokens": args.tokens, "width": args.width, "mlp": args.mlp, "millions": args.millions,
        "cast_level": args.level, "repeats": args.repeats, "rows": [],
        "times": "CUDA: kernel times on the device clock per call (profiler); CPU: median wall time per call",
    }
    path = write_result("static_shapes", device, result, args.out)
    rows = optimizer_rows(args.millions, args.width, args.levels, device, args.repeats)
    for row in rows:  # the optimizer first: its update is the larger open question
        result["rows"].append(row)
        print(summary(row))
        path = write_result("static_shapes", device, result, args.out)
    reset_compiler()
    for name, dynamic, static, call_args in recorded_casts(args.level, args.tokens, args.width, args.mlp, device):
        row = compare(name, dynamic, static, call_args, device, args.repeats)
        result["rows"].append(row)
        print(summary(row))
        path = write_result("static_shapes", device, result, args.out)
    return path


if __name__ == "__main__":
    main()
