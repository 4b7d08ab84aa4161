"""The Triton kernels Inductor generates for amp8's compiled functions, read without a GPU.

    pip install triton==3.6.0                 # on a machine without a GPU: code generation only
    python bench/triton_code.py               # the optimizer's update O1-O3, an FP8 MLP's casts
    python bench/triton_code.py --keep /tmp/code   # and the generated code, one file per case

What a compiled function costs on a GPU follows from the kernels Inductor writes for it:
how many, and how often each reads a row of its inputs. A reduction over a row (an amax,
a row scale) whose result the rest of the row waits on is either *persistent* (the row
stays in registers: one read) or *looped* (one loop over the row per pass: the row is
read again for each), and Inductor can only keep a row in registers when it knows the
row's length: amp8 compiles for every shape (``dynamic=True``), so this also compiles
each case for the shapes at hand (``dynamic=False``) to show what that costs.

Without a CUDA device Inductor still generates the GPU's Triton code when it targets
Triton for the CPU (``torch._inductor.config.cpu_backend = "triton"``) and Triton's
active driver reports a GPU (an sm_90 target here, ``_CodegenOnlyDriver``): the code is
captured as Inductor writes it (``GraphLowering.save_output_code``) and the compile stops
when Triton looks for a backend to build it with, so nothing runs. Each case is the
function amp8 compiles, on the arguments amp8 hands it: the optimizer's group update over
``--width`` x ``--width`` layers (``amp8.optim.group_step``), and every cast of one forward
and backward of a ``--width`` -> 4 x ``--width`` -> ``--width`` MLP of FP8 layers, the
tokens ``--tokens`` (``amp8.nn.cast_kernels``, the weight gradient's quantization). Per
case and variant: each kernel's kind (pointwise, looped reduction and its loops,
persistent reduction), loads and stores, size hint, and the passes the kernels over the
whole data make over it (``data_passes``: a looped reduction reads a row once per loop);
and each looped reduction built for sm_90 by Triton's own assembler, with its machine
instructions per element (``sass``, ``bench/sass.py``; ``--no-sass`` skips the build).
Results go to ``--out``/triton_code-cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch import nn

import amp8
import amp8._compiled
from amp8.optim import LowBitAdam
from amp8.optim.group_step import COMPILE_OPTIONS, adam_group_step, in_sixteens
from amp8.quant import scaling
import sass
from optimizer import backward_pass, square_layers
from records import RESULTS, write_result
from static_shapes import cast_case

_SIZE_HINTS = re.compile(r"size_hints=\{([^}]*)\}")
_STATEMENT = re.compile(r"^\s+_?tmp\d+ = ", re.MULTILINE)
_QUOTIENT = re.compile(r"\(tmp\d+ / tmp\d+\)")
_DIVISION = re.compile(r"= " + _QUOTIENT.pattern)
_CONVERSION = re.compile(r"\.to\(tl\.float(?:16|32)\)")
_ASSIGNMENT = re.compile(r"^\s+(\w+) = (.*)$", re.MULTILINE)
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")
_ELEMENT_INDEX = re.compile(r"^r0_|^rindex$|^roffset$|^rbase$")
_REDUCTION_CALL = re.compile(r"\b(?:max2|min2|sum|reduce|welford\w*)\(")


def element_statements(body: str) -> list[str]:
    """A reduction kernel's statements whose values differ from element to element of a
    row (they read the reduced dim's index, or such a value): what runs once per element.
    The rest are per row or constant, and Triton's loop-invariant code motion computes them
    once outside the loop, wherever Inductor wrote them."""
    varying: set[str] = set()
    statements = []
    for name, value in _ASSIGNMENT.findall(body):
        if _REDUCTION_CALL.search(value):  # a row's reduction: one value per row
            continue
        if _ELEMENT_INDEX.match(name) or any(n in varying or _ELEMENT_INDEX.match(n) for n in _NAME.findall(value)):
            varying.add(name)
            if re.fullmatch(r"_?tmp\d+", name):
                statements.append(value)
    return statements


def kernel_summary(wrapper_code: str) -> list[dict[str, Any]]:
    """Each Triton kernel in one compiled graph's wrapper code (Inductor's output code):
    its name, kind (``pointwise``, ``looped reduction``, ``persistent reduction``), loops
    over the reduced dim, loads and stores, and its arithmetic: the values it computes
    (``tmpN = ...`` statements; inside a loop, each per element) and, of them, float
    divisions (several instructions each on a GPU) and conversions between float16 and
    float32 (issued at a fraction of the float32 rate); for a reduction, the same counts
    over the statements computed per element of a row (``element_statements``)."""
    kernels = []
    for name, source in sass.kernel_sources(wrapper_code).items():
        body = source[source.find(f"def {name}("):]
        hints = _SIZE_HINTS.search(source)
        elements = 1
        for size in re.findall(r":\s*(\d+)", hints.group(1) if hints else ""):
            elements *= int(size)
        loops = body.count("for r0_offset in ")
        kind = "pointwise" if name.startswith("triton_poi") else "looped reduction" if loops else \
            "persistent reduction" if name.startswith(("triton_per", "triton_red")) else "other"
        per_element = element_statements(body) if kind.endswith("reduction") else []
        kernels.append({"name": name, "kind": kind, "loops": loops, "size_hint": elements,
                        "loads": body.count("tl.load("), "stores": body.count("tl.store("),
                        "statements": len(_STATEMENT.findall(body)), "divisions": len(_DIVISION.findall(body)),
                        "conversions": len(_CONVERSION.findall(body)),
                        "element_statements": len(per_element),
                        "element_divisions": sum(bool(_QUOTIENT.fullmatch(value)) for value in per_element),
                        "element_conversions": sum(len(_CONVERSION.findall(value)) for value in per_element)})
    return kernels


def case_summary(codes: list[str]) -> dict[str, Any]:
    """The kernels of a case's graphs, and the passes they make over its data: the kernels
    whose size hint (elements, a power of two) is the case's largest each read the data
    once per loop over a row, or once where they have none (pointwise, persistent)."""
    kernels = [kernel for code in codes for kernel in kernel_summary(code)]
    largest = max((kernel["size_hint"] for kernel in kernels), default=0)
    data_passes = sum(max(kernel["loops"], 1) for kernel in kernels if kernel["size_hint"] == largest)
    return {"kernels": len(kernels), "data_passes": data_passes, "detail": kernels}


class _CodegenOnlyDriver:
    """A Triton driver that reports a GPU target and runs nothing: what Inductor asks of
    one while it writes Triton code."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def gpu_codegen(arch: int = 90) -> Iterator[None]:
    """Inductor writes Triton code for CPU tensors as for an sm_``arch`` GPU (see the module
    docstring), and amp8 takes the code paths it takes on a GPU (``scaling.clips_by_fmax``);
    the settings and Triton's driver are restored after. An input is taken as aligned as
    it would be on a GPU: where its storage offset is known to keep it on 16 bytes
    (Inductor assumes no alignment of CPU tensors, so its kernels would load and store
    one element at a time where a GPU's take several)."""
    from torch._inductor import graph, utils
    from triton.runtime import driver
    previous = getattr(driver, "_active", None)  # None: Triton looks for a real driver when next asked
    driver.set_active(_CodegenOnlyDriver(arch))
    try:
        with torch._inductor.config.patch(cpu_backend="triton", compile_threads=1), warnings.catch_warnings(), \
                mock.patch.object(scaling, "clips_by_fmax", lambda values: True), \
                mock.patch.object(graph, "should_assume_input_aligned", utils.tensor_is_aligned):
            warnings.filterwarnings("ignore", message="Could not find an active CPU backend")  # we run nothing
            yield
    finally:
        driver.set_active(previous)


def generated_code(fn: Callable[..., Any], args: tuple[Any, ...], dynamic: bool,
                   options: dict[str, Any] | None = None) -> list[str]:
    """The wrapper code (with its kernels) of each graph Inductor generates for ``fn(*args)``
    compiled with ``dynamic``; its compile stops there (see the module docstring)."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    torch._dynamo.reset()
    quiet = logging.getLogger("torch._inductor.runtime.triton_heuristics")  # it logs each stopped compile
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)(*args)
    except Exception:  # the compile stops where Triton would build the kernels
        if not codes:
            raise
    finally:
        quiet.setLevel(level)
    return codes


def optimizer_cases(levels: list[str], width: int) -> Iterator[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    """``(case, function, arguments, compile options)`` of each level's group update, its
    arguments those of a real step over ``width`` x ``width`` FP8 layers."""
    for level in levels:
        torch.manual_seed(0)
        model, _ = amp8.initialize(square_layers(1, width, torch.device("cpu")), None, level, layer_selection="all")
        optimizer = LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), amp8.LEVELS[level],
                                              fused=False)
        recorded: list[tuple[Any, tuple[Any, ...]]] = []
        steps = optimizer._group_steps[False]
        build = steps._build

        def recording_build(spec: Any, build: Callable[..., Any] = build) -> Callable[..., Any]:
            eager = build(spec)

            def step(*args: Any) -> Any:
                recorded.append((spec, args))
                return eager(*args)
            return step

        with mock.patch.object(steps, "_build", recording_build):
            backward_pass(model, optimizer, torch.device("cpu"))()
            optimizer.step()
        for spec, (tensors, *rest) in recorded:  # the buffers as the compiled step takes them
            yield (f"{level} group update ({spec.weight.value} weights)",
                   lambda *xs, spec=spec: adam_group_step(spec, *xs), (in_sixteens(tensors), *rest), COMPILE_OPTIONS)


def cast_cases(width: int, tokens: int) -> Iterator[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]:
    """``(case, function, arguments, compile options)`` of each cast of one forward and
    backward of an FP8 MLP at O1 (recorded on 64 tokens; a cast of activations is handed
    ``tokens`` rows)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    model, _ = amp8.initialize(model, None, "O1", layer_selection="all", compiled_casts=False)
    recorded: list[tuple[Callable[..., Any], Any, tuple[Any, ...]]] = []

    def recording(function: Callable[..., Any], spec: Any, variant: Any = None) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            recorded.append((function, spec, args))
            return function(spec, *args)
        return call

    with mock.patch.object(amp8._compiled, "compiled_for", recording), \
            mock.patch.object(amp8._compiled, "runs_compiled", lambda x, compiled: True):
        model(torch.randn(64, width)).square().mean().backward()
    def resized(x: torch.Tensor) -> torch.Tensor:  # an activation or its gradient: as many rows as tokens
        return torch.zeros(tokens, *x.shape[1:], dtype=x.dtype) if x.shape[0] == 64 else x

    for function, spec, args in recorded:
        inputs = tuple(map(resized, args[0])) if isinstance(args[0], tuple) else resized(args[0])
        args = (inputs, *args[1:])
        yield cast_case(function, spec, args), lambda *xs, function=function, spec=spec: function(spec, *xs), args, {}


def add_sass(summary: dict[str, Any], codes: list[str]) -> None:
    """Give each looped reduction of ``case_summary``'s ``summary`` its SASS count per
    element (``sass.per_element``: built for sm_90, with the GPU compiler's own folding
    and expansions)."""
    sources = {name: source for code in codes for name, source in sass.kernel_sources(code).items()}
    for kernel in summary["detail"]:
        if kernel["kind"] == "looped reduction":
            kernel["sass"] = sass.per_element(kernel["name"], sources[kernel["name"]])


def main(argv: list[str] | None = None) -> Path:
    """Generate and summarize every case's code; the JSON's path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", default=["O1", "O2", "O3"], help="the optimizer's levels")
    parser.add_argument("--width", type=int, default=1024, help="the optimizer's layers' width")
    parser.add_argument("--mlp-width", type=int, default=2048, help="the MLP's width (its hidden layer is 4x)")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the MLP's activations")
    parser.add_argument("--no-casts", action="store_true", help="the optimizer's cases only")
    parser.add_argument("--keep", type=Path, default=None, help="write each case's generated code here")
    parser.add_argument("--no-sass", action="store_true",
                        help="skip building the looped reductions for sm_90 to count their SASS (bench/sass.py)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    args = parser.parse_args(argv)
    import triton  # noqa: F401  (code generation needs it; nothing is built or run)

    result: dict[str, Any] = {"triton": triton.__version__, "target": "sm_90 (generated; looped reductions built, nothing run)",
                              "width": args.width, "mlp_width": args.mlp_width, "tokens": args.tokens, "cases": []}
    cases = list(optimizer_cases(args.levels, args.width))
    if not args.no_casts:
        cases += list(cast_cases(args.mlp_width, args.tokens))
    path = RESULTS
    with gpu_codegen():
        for index, (case, fn, call_args, options) in enumerate(cases):
            row: dict[str, Any] = {"case": case}
            for variant, dynamic in (("dynamic", True), ("static", False)):
                codes = generated_code(fn, call_args, dynamic, options)
                row[variant] = case_summary(codes)
                if not args.no_sass:
                    add_sass(row[variant], codes)
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"{index:02d}-{variant}.py").write_text("\n\n".join(codes))
            result["cases"].append(row)
            print(f"{case}: dynamic {row['dynamic']['kernels']} kernels, {row['dynamic']['data_passes']} passes over "
                  f"the data; static {row['static']['kernels']} kernels, {row['static']['data_passes']}")
            path = write_result("triton_code", torch.device("cpu"), result, args.out)
    return path


if __name__ == "__main__":
    main()
