"""amp8 uses no private torch API beyond an allowlist, each entry with its reason.

The scope is private ``torch.distributed``, ``DistributedDataParallel`` and autograd-engine
API: an attribute with one of their private names (``_get_active_ddp_module``,
``_comm_hooks``, ``_execution_engine``, ...; read from torch itself: DDP's class and the
attributes its source uses, ``torch.distributed``'s namespace, its process group, work and
bucket types, the autograd engine and graph nodes) is caught on any object. More broadly,
every name beginning with an underscore reached from torch's own modules by path
(``torch._scaled_mm``, ``from torch.utils._pytree import ...``) is caught too, so the
features amp8 builds on are listed here with theirs. ``getattr`` / ``setattr`` /
``hasattr`` / ``delattr`` with a constant name count as attribute access, and a string
constant equal to a private name of the scope counts as one (no indirection through a
name kept in a variable). Dunders are not private.
"""

from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

AMP8 = Path(__file__).resolve().parents[1] / "amp8"

ALLOWED: dict[str, str] = {
    "torch._inductor": (
        "config.cpu_backend, read while tracing the optimizer's noise words: Inductor's C++ "
        "leaves loops holding uint32 values unvectorized (5-6x slower), so there the words stay "
        "int64, and torch has no public way to ask which backend compiles a CPU graph"
    ),
    # -- the scope: torch.distributed, DDP, the autograd engine ------------------------------
    "_ddp_params_and_buffers_to_ignore": (
        "DDP's only opt-out for parameters and buffers: its constructor reads this attribute of "
        "the module it wraps. amp8 lists the FP8 weights and buffers there (their gradients are "
        "FP8 tensors DDP's buckets cannot hold); torch has no public argument for it, and DDP's "
        "own setter is a private static method, which amp8 does not call"
    ),
    "torch.autograd.Variable._execution_engine": (
        "queue_callback: runs the FP8 weights' averaging when a backward ends under DDP's "
        "find_unused_parameters=True, on every rank after DDP's own collectives. torch has no "
        "public end-of-backward callback; its DDP comm hooks and FSDP use this one"
    ),
    "torch._C._autograd._get_current_graph_task_keep_graph": (
        "whether the running backward keeps its graph (retain_graph=True): an FP8 layer's "
        "backward frees its FP8 weight copy unless the graph is kept, and autograd tells a "
        "Function's backward no other way"
    ),
    "torch._C._current_graph_task_id": (
        "whether code runs inside a backward (-1 outside): where activation checkpointing runs a "
        "forward again, whose FP8 casts must repeat the first forward's scales and record nothing "
        "(amp8/_compat.py running_backward). torch.utils.checkpoint asks the same function; torch "
        "has no public way to ask"
    ),
    "torch._C._current_autograd_node": (
        "the backward node running now: when an FP8 weight gradient is written into a plain tensor, "
        "whether that is autograd's AccumulateGrad adding it to a plain .grad assigned by hand (the "
        "error then says to clear .grad) or an optimizer's step (the error names amp8's optimizer). "
        "Read only on that error's path; torch has no public way to ask"
    ),
    # -- beyond the scope: torch features amp8 builds on ---------------------------------------
    "torch._library": (
        "opaque_object.register_opaque_type: a custom operator takes the optimizer's GradSlot and torch.compile "
        "passes it through a graph by reference, so a compiled backward claims the slot when it runs "
        "and writes the FP8 gradient where the step reads it (amp8/tensor/weight_grad.py). torch has "
        "no public name for opaque objects; amp8/_compat.py probes it, and without it compiled "
        "backwards take no slot"
    ),
    "torch._C._dynamo": (
        "eval_frame.get_eval_frame_callback: whether a torch.compile wrapper's call is running, also "
        "where Dynamo runs a forward's hooks eagerly between its graphs (torch.compiler.is_compiling() "
        "is False there), so FP8 activations, which a compiled region cannot store, are refused "
        "(amp8/_compat.py inside_compiled_call). torch has no public way to ask; probed, and without it "
        "only traced code is seen"
    ),
    "torch._opaque_base": (
        "OpaqueBase: the base class register_opaque_type requires of an opaque type (the same feature)"
    ),
    "torch.utils._python_dispatch": (
        "is_in_torch_dispatch_mode: whether a torch dispatch mode (a FLOP counter, a tracer) is active, "
        "under which torch.compile(fullgraph=True) runs nothing and raises; amp8's compiled casts then "
        "run eagerly (amp8/_compiled.py). torch.compile itself asks the same function; torch has no "
        "public one"
    ),
    "torch._dynamo": (
        "the errors torch.compile(fullgraph=True) raises where it cannot compile a function for the "
        "arguments it got or its backend fails (exc.Unsupported, exc.FailOnRecompileLimitHit, "
        "exc.BackendCompilerFailed): amp8's compiled casts catch them and run the cast eagerly "
        "(amp8/_compiled.py); torch exports no public name for them"
    ),
    **{
        f"torch._foreach_{op}": (
            "torch's multi-tensor kernels, one launch over a list of tensors: the step counts of plain "
            "float32 parameters (amp8/optim/plain_step.py), as torch.optim.Adam(fused=True) advances them "
            "(and takes a skipped step back, found_inf), "
            "the copies in and out of its update groups' flat buffers (amp8/optim/update_groups.py), and the "
            "finiteness check of many gradients (amp8/quant/scaling.py); torch has no public multi-tensor API"
        )
        for op in ("add_", "sub_", "copy_", "norm")
    },
    **{
        f"torch._fused_{name}_": (
            "torch's fused Adam kernel, the one torch.optim.Adam(fused=True) calls: LowBitAdam's step of "
            "plain float32 parameters (amp8/optim/plain_step.py), one call for all of them; torch has no "
            "public functional form of it"
        )
        for name in ("adam", "adamw")
    },
    "torch._scaled_mm": "the FP8 GEMM (cuBLASLt on CUDA, a reference kernel on the CPU); amp8/ops only",
    "torch._scaled_grouped_mm": (
        "the grouped FP8 GEMM of MoE experts (CUDA sm_90 and sm_100); amp8/ops only. Its meta kernel "
        "repeats the CUDA kernel's checks, so amp8 checks the grouped call's arguments on the CPU too; the "
        "public torch.nn.functional.scaled_grouped_mm calls _scaled_grouped_mm_v2, which torch 2.13 gives "
        "no meta kernel"
    ),
    "torch.Tensor._make_wrapper_subclass": (
        "how a tensor subclass holding FP8 data and scales (WeightGrad) presents the weight's "
        "shape and dtype; the constructor torch documents for wrapper subclasses"
    ),
    "torch.ops.aten._unsafe_view": (
        "an FP8 GEMM's fresh (M, N) output reshaped to (..., N) without making it a view, as torch's "
        "own matmul does: a view made inside an autograd Function cannot be changed in place"
    ),
    "torch._C._disabled_torch_function_impl": (
        "turns __torch_function__ off for a __torch_dispatch__ subclass, as torch's subclass "
        "examples do"
    ),
    "torch.utils._pytree": (
        "tree_flatten / tree_map over a dispatched operation's arguments in WeightGrad's "
        "__torch_dispatch__; torch ships its pytree under this name only"
    ),
    "torch.ops.aten._to_copy": (
        "the ATen operator .to() dispatches to, which WeightGrad's __torch_dispatch__ handles; "
        "an operator's name in the dispatcher, not Python API"
    ),
}
"""Each private name amp8 uses: a dotted path reached from torch's modules, or (starting
with an underscore) a name of the scope on any object; the value says why."""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private(names: Iterable[str]) -> set[str]:
    return {name for name in names if _is_private(name)}


def scope_names() -> set[str]:
    """Private names of torch.distributed, DDP and the autograd engine, read from torch;
    ``nn.Module``'s own names are left out (amp8's modules override ``_apply`` and such)."""
    ddp = nn.parallel.DistributedDataParallel
    source = ast.parse(Path(inspect.getfile(ddp)).read_text())
    names = _private(node.attr for node in ast.walk(source) if isinstance(node, ast.Attribute))
    names |= _private(vars(ddp)) | _private(dir(dist))
    for kind in (dist.ProcessGroup, dist.Work, dist.GradBucket, torch.autograd.graph.Node):
        names |= _private(dir(kind))
    names |= {"_execution_engine"} | _private(dir(torch.autograd.Variable._execution_engine))
    names -= _private(vars(nn.Module)) | _private(vars(nn.Module()))
    return names - {"_C"}  # torch._C is reached by path, and checked as such


class _Scanner(ast.NodeVisitor):
    """Collects the private torch names one module of amp8 uses, with where."""

    def __init__(self, where: str, scope: set[str]) -> None:
        self.where = where
        self.scope = scope
        self.aliases: dict[str, str] = {}
        self.found: dict[str, list[str]] = defaultdict(list)

    def scan(self, tree: ast.Module) -> dict[str, list[str]]:
        for node in ast.walk(tree):  # aliases first: imports and assignments of torch paths
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._import(node)
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = self._path(node.value)
                if path is not None:
                    self.aliases[node.targets[0].id] = path
        self.visit(tree)
        return self.found

    def _add(self, key: str, node: ast.AST) -> None:
        self.found[key].append(f"{self.where}:{getattr(node, 'lineno', 0)}")

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    self._check_path(alias.name, node)
                    bound = alias.asname or alias.name.split(".")[0]
                    self.aliases[bound] = alias.name if alias.asname else "torch"
            return
        module = node.module or ""
        if module.split(".")[0] != "torch":
            return
        self._check_path(module, node)
        for alias in node.names:
            path = f"{module}.{alias.name}"
            self._check_path(path, node)
            self.aliases[alias.asname or alias.name] = path

    def _path(self, node: ast.AST) -> str | None:
        """The dotted torch path ``node`` names (``dist.Work`` -> ``torch.distributed.Work``)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _check_path(self, path: str, node: ast.AST) -> None:
        """Record ``path`` up to its last private part, if it has one."""
        parts = path.split(".")
        private = [index for index, part in enumerate(parts) if _is_private(part)]
        if private:
            self._add(".".join(parts[: private[-1] + 1]), node)

    def _check_name(self, owner: ast.AST, name: str, node: ast.AST) -> None:
        base = self._path(owner)
        if base is not None:
            self._check_path(f"{base}.{name}", node)
        elif name in self.scope:
            self._add(name, node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check_name(node.value, node.attr, node)
        if self._path(node.value) is None:  # an outer access of a torch path covers the inner ones
            self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        accessors = ("getattr", "setattr", "hasattr", "delattr")
        if isinstance(node.func, ast.Name) and node.func.id in accessors and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value):
                self._check_name(node.args[0], name.value, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in self.scope:
            self._add(node.value, node)


def scan(files: dict[str, str]) -> dict[str, list[str]]:
    """``{private name or path: [where it is used]}`` over ``{file name: source}``."""
    scope = scope_names()
    found: dict[str, set[str]] = defaultdict(set)
    for where, source in files.items():
        for key, places in _Scanner(where, scope).scan(ast.parse(source)).items():
            found[key].update(places)
    return {key: sorted(places, key=lambda place: (place.rsplit(":", 1)[0], int(place.rsplit(":", 1)[1])))
            for key, places in found.items()}


def amp8_sources() -> dict[str, str]:
    return {str(path.relative_to(AMP8.parent)): path.read_text() for path in sorted(AMP8.rglob("*.py"))}


def test_amp8_uses_no_private_torch_api_beyond_the_allowlist() -> None:
    unexpected = {key: places for key, places in scan(amp8_sources()).items() if key not in ALLOWED}
    assert not unexpected, (
        "private torch API outside the allowlist (use torch's public API, or add the name to "
        f"ALLOWED in tests/test_private_api.py with the reason torch offers no public one): {unexpected}"
    )


def test_every_allowlist_entry_is_used_and_has_a_reason() -> None:
    used = scan(amp8_sources())
    stale = sorted(key for key in ALLOWED if key not in used)
    assert not stale, f"allowlisted but no longer used, remove them: {stale}"
    assert all(len(reason.split()) >= 8 for reason in ALLOWED.values())


def test_the_scan_catches_private_ddp_and_engine_api_in_any_spelling() -> None:
    source = '''
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import _functional_collectives

def f(model, ddp):
    nn.parallel.DistributedDataParallel._get_active_ddp_module()
    DDP._set_params_and_buffers_to_ignore_for_model(model, [])
    torch.autograd.Variable._execution_engine.queue_callback(print)
    hooks = ddp._comm_hooks
    getattr(ddp, "_module_parameters")
    dist._functional_collectives
    name = "_ddp_params_and_buffers_to_ignore"
    self._comm_hooks
'''
    found = scan({"example.py": source})
    assert set(found) == {
        "torch.nn.parallel.DistributedDataParallel._get_active_ddp_module",
        "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        "torch.autograd.Variable._execution_engine",
        "torch.distributed._functional_collectives",
        "_comm_hooks", "_module_parameters", "_ddp_params_and_buffers_to_ignore",
    }, found
    assert found["_comm_hooks"] == ["example.py:12", "example.py:16"]
