"""What amp8 compiles for itself, and whether it can: ``torch.compile`` of a private
copy of a function's code, and the compiler each device needs."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import types
import warnings
from typing import Any, Callable, Hashable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def compile_privately(function: Callable[..., Any], options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """``torch.compile(function)`` (full graph, dynamic shapes) over a private copy of its
    code. torch.compile keeps its graphs, and its limit of recompiles, per code object: a
    private copy gives each caller its own, so one caller's graphs never push another's
    past that limit (and back to eager)."""
    private = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__,
        function.__closure__,
    )
    return torch.compile(private, fullgraph=True, dynamic=True, options=options)


def cpp_compiler_found() -> bool:
    """Whether a C++ compiler is on the PATH (``$CXX``, g++, clang++ or c++): what
    torch.compile needs to compile for the CPU."""
    names = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    return any(name and shutil.which(name) for name in names)


@functools.cache
def compiler_found(device_type: str) -> bool:
    """Whether torch.compile can compile for ``device_type`` here: a C++ compiler for the
    CPU, Triton for CUDA; no other device. Looked up once per process."""
    if device_type == "cpu":
        return cpp_compiler_found()
    if device_type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return False


COMPILED_SPECS = 64
"""The most (function, spec) pairs whose compiled functions ``compiled_for`` keeps: a
training run uses a handful (each role and layout of one recipe, training and eval);
the least recently used is dropped past this, and compiled again if it comes back."""


@functools.lru_cache(maxsize=COMPILED_SPECS)
def compiled_for(function: Callable[..., Any], spec: Hashable, variant: Hashable = None) -> Callable[..., Any]:
    """``function(spec, *args)`` compiled (see ``compile_privately``): one compiled
    function per spec and ``variant`` (what else would make its graphs differ: the
    input's dtype, which arguments are None) serves every caller and every shape."""

    def call(*args: Any) -> Any:
        return function(spec, *args)

    return compile_privately(call)


Inputs = torch.Tensor | tuple[torch.Tensor, ...]
"""What work that may run compiled works on: one tensor, or a tuple of them."""


def runs_compiled(x: Inputs, compiled: bool) -> bool:
    """Whether work on ``x`` (a tensor, or a tuple of tensors) that may run compiled
    does: asked to, outside any compiled region and any torch dispatch mode (a FLOP
    counter, say: torch.compile runs nothing under one), for plain tensors that are not
    empty (not a subclass such as a DTensor) on a device a compiler is found for."""
    tensors = x if isinstance(x, tuple) else (x,)
    return (
        compiled and len(tensors) > 0
        and all(type(tensor) is torch.Tensor and tensor.numel() > 0 for tensor in tensors)
        and not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode(include_infra_modes=False)
        and all(compiler_found(tensor.device.type) for tensor in tensors)
    )


def _signature(arg: Any) -> Hashable:
    """What of an argument makes a compiled function's graphs differ beyond its sizes:
    a tensor's dtype, None, or a tuple's items' signatures."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype
    if isinstance(arg, tuple):
        return tuple(_signature(item) for item in arg)
    return arg is None


def call_compiled(function: Callable[..., Any], spec: Hashable, x: Inputs, *args: Any,
                  compiled: bool = False) -> Any:
    """``function(spec, x, *args)``, as compiled kernels where ``runs_compiled(x, compiled)``
    (the same bits either way), else eagerly; eagerly too, with a warning, where torch
    cannot compile it for these arguments or its compiler fails (it then ran nothing)."""
    if not runs_compiled(x, compiled):
        return function(spec, x, *args)
    variant = (_signature(x), tuple(_signature(arg) for arg in args), torch.is_grad_enabled())
    try:
        return compiled_for(function, spec, variant)(x, *args)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit,
            torch._dynamo.exc.BackendCompilerFailed) as error:
        warnings.warn(
            f"amp8 could not compile {function.__name__} for {spec} and runs it eagerly, with the same "
            f"bits ({type(error).__name__}: {str(error).splitlines()[0]}); pass compiled_casts=False to "
            "amp8.initialize to skip trying", RuntimeWarning, stacklevel=2,
        )
        return function(spec, x, *args)
