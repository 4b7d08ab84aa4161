"""The package's folders are its layers: imports go down them, never up, and no module
imports itself back through others. Read from the source (the AST), so a new import
that breaks the order fails here before it can tangle anything."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "amp8"

LAYERS: dict[str, int] = {
    "amp8._compat": 0,
    "amp8._compiled": 0,
    "amp8._version": 0,
    "amp8.config": 0,
    "amp8.quant": 1,
    "amp8.tensor": 2,
    "amp8.ops": 3,
    "amp8.nn": 4,
    "amp8.optim": 4,
    "amp8.distributed": 5,
    "amp8.monitor": 6,
    "amp8": 7,  # the API: initialize, export, the package's own __init__
    "amp8.tools": 8,
}
"""Each part of the package and its layer: a module may import its own part and parts of
a lower layer. Parts of one layer do not import each other."""

KNOWN_UPWARD: dict[tuple[str, str], str] = {
    ("amp8", "amp8.tools.experiments.compare"): "amp8.compare loads the experiments on first call only",
}
"""Imports against the order, each with why it is there (DESIGN.md, "Layout")."""


def part_of(module: str) -> str:
    """The entry of ``LAYERS`` that holds ``module`` (the longest matching prefix)."""
    matches = [part for part in LAYERS if module == part or module.startswith(part + ".")]
    return max(matches, key=len)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, module: str, is_package: bool, annotations: bool = False) -> set[str]:
    """The amp8 modules ``source`` imports when it runs (imports under ``TYPE_CHECKING``
    are for annotations and never run; with ``annotations`` they count too); ``from a
    import b`` counts as ``a.b`` where ``b`` is a module of the package, else as ``a``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not annotations:
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name.split(".")[0] == "amp8")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                if base.split(".")[0] != "amp8":
                    continue
                for alias in child.names:
                    candidate = f"{base}.{alias.name}"
                    found.add(candidate if _exists(candidate) else base)
            visit(child)

    visit(ast.parse(source))
    return found


def _exists(module: str) -> bool:
    path = PACKAGE.parent / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (``annotations``:
    see ``imports_of``)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        graph[name] = imports_of(path.read_text(), name, path.name == "__init__.py", annotations)
    return graph


def order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes up the layers or across parts of one layer."""
    wrong = []
    for module, targets in graph.items():
        here = part_of(module)
        for target in sorted(targets):
            there = part_of(target)
            upward = LAYERS[there] > LAYERS[here] or (LAYERS[there] == LAYERS[here] and there != here)
            if upward and (module, target) not in KNOWN_UPWARD:
                wrong.append(f"{module} (layer {LAYERS[here]}) imports {target} (layer {LAYERS[there]})")
    return wrong


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_every_module_belongs_to_a_layer() -> None:
    graph = import_graph()
    assert len(graph) > 60
    assert {part_of(module) for module in graph} == set(LAYERS)


def test_imports_go_down_the_layers() -> None:
    assert order_violations(import_graph()) == []


def test_the_known_exceptions_still_exist() -> None:
    """An exception that is gone leaves the list, so the list stays true."""
    graph = import_graph()
    assert [pair for pair in KNOWN_UPWARD if pair[1] not in graph.get(pair[0], ())] == []


def test_there_are_no_import_circles() -> None:
    # Annotation-only imports count: a module that names another's type in a signature
    # while that one imports it back is one piece split in two.
    assert cycles(import_graph(annotations=True)) == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("amp8.quant.scaling", "from amp8.nn.linear import Fp8Linear\n", "amp8.nn.linear"),
    ("amp8.tensor.scaled", "from ..ops import gemm\n", "amp8.ops.gemm"),
    ("amp8.nn.linear", "import amp8.monitor.controller\n", "amp8.monitor.controller"),
    ("amp8.nn.swap", "from amp8.optim import adam\n", "amp8.optim.adam"),
])
def test_an_upward_import_is_caught(module, source, expected) -> None:
    graph = {module: imports_of(source, module, is_package=False)}
    assert graph[module] == {expected}
    assert len(order_violations(graph)) == 1


def test_annotations_only_imports_do_not_count_for_the_layers_but_do_for_circles() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from amp8.nn.linear import Fp8Linear\n"
    assert imports_of(source, "amp8.quant.health", is_package=False) == set()
    assert imports_of(source, "amp8.quant.health", is_package=False, annotations=True) == {"amp8.nn.linear"}


def test_a_circle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow  # a fresh Python process
def test_import_amp8_loads_no_tool() -> None:
    """``import amp8`` in a fresh Python loads neither the tools (the experiments, the
    command) nor matplotlib, which the tools use."""
    code = "import sys, amp8; print(sorted(m for m in sys.modules if m.startswith(('amp8.', 'matplotlib'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "amp8.tools" not in loaded and "matplotlib" not in loaded, loaded
