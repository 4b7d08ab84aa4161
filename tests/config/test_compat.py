"""The torch feature table (``amp8._compat``) against the installed torch, the declared
torch range, and the exact CPU emulation of scaled GEMMs that stands in for a missing
kernel."""

import ast
import re
from typing import Callable

import pytest
import torch

from amp8 import _compat
from amp8.config.formats import E4M3, E5M2
from amp8.config.gemms import Gemm
from amp8.ops.gemm import emulated_scaled_mm, fp8_mm
from amp8.quant import scaling
from conftest import ROOT, assert_bitwise_equal

NATIVE_ROWWISE = pytest.mark.skipif(
    not _compat.CPU_ROWWISE_SCALED_MM.available(),
    reason=str(_compat.CPU_ROWWISE_SCALED_MM.missing_reason()),
)


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.15.0", (2, 15)),
     ("2.16.0a0+git1234abc", (2, 16)), ("10.2", (10, 2))],
)
def test_parse_version(version: str, expected: tuple[int, int]) -> None:
    assert _compat.parse_version(version) == expected


@pytest.mark.parametrize("version", ["nightly", "", "2"])
def test_parse_version_refuses_what_is_no_release(version: str) -> None:
    with pytest.raises(ValueError, match="expected 'MAJOR.MINOR"):
        _compat.parse_version(version)


def test_the_installed_torch_is_in_the_supported_range() -> None:
    assert _compat.OLDEST_TORCH <= _compat.torch_version() <= _compat.NEWEST_TORCH, torch.__version__


def _cpu_rowwise_scaled_mm_runs() -> bool:
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


PROBES: dict[_compat.TorchFeature, Callable[[], bool]] = {
    _compat.CPU_ROWWISE_SCALED_MM: _cpu_rowwise_scaled_mm_runs,
}
PROBED_ELSEWHERE = {  # probes that need torch.compile or two processes
    _compat.COMPILED_SHARDED_LAYERS: "tests/nn/test_compile.py::test_sharded_layers_trace_where_the_table_says",
    _compat.DYNAMIC_SHAPE_LAYERS: "tests/nn/test_compile.py::test_dynamic_shapes_trace_where_the_table_says",
}


def test_every_feature_is_checked_against_torch() -> None:
    assert set(PROBES) | set(PROBED_ELSEWHERE) == set(_compat.FEATURES)


@pytest.mark.parametrize("feature", PROBES, ids=lambda feature: feature.name)
def test_the_table_says_what_this_torch_does(feature: _compat.TorchFeature) -> None:
    assert PROBES[feature]() == feature.available(), f"torch {torch.__version__}: {feature.name}"


@pytest.mark.parametrize(("version", "has_it"), [((2, 10), False), ((2, 11), False), ((2, 12), True), ((3, 0), True)])
def test_missing_reason_names_the_release_that_has_it(version: tuple[int, int], has_it: bool) -> None:
    reason = _compat.CPU_ROWWISE_SCALED_MM.missing_reason(version)
    if has_it:
        assert reason is None
    else:
        assert reason == (f"torch {version[0]}.{version[1]} lacks row-wise scales in torch._scaled_mm on "
                          "the CPU; torch 2.12 or newer has it")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_cuda_always_has_rowwise_scaled_mm(device_type: str) -> None:
    expected = device_type == "cuda" or _compat.CPU_ROWWISE_SCALED_MM.available()
    assert _compat.native_rowwise_scaled_mm(torch.device(device_type)) == expected


def test_fsdp_wrappers_are_known_where_torch_has_distributed() -> None:
    from torch.distributed.fsdp import FSDPModule

    assert torch.distributed.is_available(), "the suite's data-parallel tests need torch.distributed"
    assert _compat.fsdp_module_types() == (FSDPModule,)


def _imports_torch(statements: list[ast.stmt]) -> bool:
    """Whether ``statements`` import torch or one of its modules."""
    for node in (part for statement in statements for part in ast.walk(statement)):
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "torch" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def _version_checks(source: str) -> list[str]:
    """What ``source`` does that reads torch's version or probes torch for a feature:
    ``torch.__version__`` in a comparison, ``hasattr``/``getattr`` of a named attribute
    of ``torch`` or its modules, and an import from torch that catches ``ImportError``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = {ast.unparse(part) for part in ast.walk(node) if isinstance(part, ast.Attribute)}
            found += sorted(name for name in names if name in ("torch.__version__", "torch.version.__version__"))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("hasattr", "getattr") and len(node.args) > 1:
            target, name = ast.unparse(node.args[0]), node.args[1]
            named = isinstance(name, ast.Constant) and isinstance(name.value, str)
            if named and (target == "torch" or target.startswith("torch.")):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Try) and _imports_torch(node.body):
            caught = {ast.unparse(handler.type) for handler in node.handlers if handler.type is not None}
            if any("ImportError" in name or "ModuleNotFoundError" in name for name in caught):
                found.append(f"except {' '.join(sorted(caught))}")
    return found


def test_the_scan_finds_version_checks() -> None:
    source = (
        "if torch.__version__ >= '2.13': pass\nok = hasattr(torch, 'float8_e8m0fnu')\n"
        "fn = getattr(torch.ops.aten, 'x', None)\ntry:\n    from torch.distributed import fsdp\n"
        "except ImportError:\n    pass\n"
        # not checks: a version recorded, a method found by a name given at run time, an
        # optional package that is not torch
        "record = {'torch': torch.__version__}\nsize = getattr(layer, 'weight')\n"
        "method = getattr(torch.Tensor, name, None)\ntry:\n    import matplotlib\nexcept ImportError:\n    pass\n"
    )
    assert sorted(_version_checks(source)) == [
        "except ImportError", "getattr(torch.ops.aten, 'x', None)", "hasattr(torch, 'float8_e8m0fnu')",
        "torch.__version__",
    ]


def test_nothing_outside_the_compat_module_checks_the_torch_version() -> None:
    """Version checks and feature probes of torch live in ``amp8._compat`` alone."""
    package = ROOT / "amp8"
    found = {
        str(path.relative_to(package)): _version_checks(path.read_text())
        for path in sorted(package.rglob("*.py")) if path.name != "_compat.py"
    }
    assert {path: checks for path, checks in found.items() if checks} == {}


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


@pytest.mark.parametrize(
    ("path", "pattern"),
    [
        ("pyproject.toml", r'"torch>={oldest},<{after}"'),
        ("README.md", r"torch {oldest} through {newest}"),
        (".ci/run", r"torch-tier {oldest}\.\d+"),
        (".ci/newest-torch", r"torch-tier\" {newest}\.\d+"),
    ],
)
def test_the_declared_range_is_the_tested_range(path: str, pattern: str) -> None:
    oldest, newest = _compat.OLDEST_TORCH, _compat.NEWEST_TORCH
    after = (newest[0], newest[1] + 1)
    expected = pattern.format(
        oldest=re.escape(_release(oldest)), newest=re.escape(_release(newest)), after=re.escape(_release(after))
    )
    text = (ROOT / path).read_text()
    assert re.search(expected, text), f"{path} does not say {expected!r}"


def _rowwise_operands(
    m: int, k: int, n: int, a_dtype: torch.dtype, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = torch.randn(m, k) * 10, torch.randn(n, k)
    if rowwise:
        scale_a = scaling.scale_from_amax(a.abs().amax(1, keepdim=True), a_dtype)
        scale_b = scaling.scale_from_amax(b.abs().amax(1, keepdim=True), E4M3)
        a8, b8 = scaling.quantize(a, scale_a, a_dtype), scaling.quantize(b, scale_b, E4M3)
        return a8, b8.t(), scale_a, scale_b.t()
    scale_a = scaling.scale_from_amax(scaling.amax(a), a_dtype)
    scale_b = scaling.scale_from_amax(scaling.amax(b), E4M3)
    return scaling.quantize(a, scale_a, a_dtype), scaling.quantize(b, scale_b, E4M3).t(), scale_a, scale_b


EMULATION_CASES = [
    pytest.param(rowwise, marks=NATIVE_ROWWISE if rowwise else (), id="rowwise" if rowwise else "tensorwise")
    for rowwise in (False, True)
]


@pytest.mark.parametrize("rowwise", EMULATION_CASES)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 16, 16), (7, 48, 32), (33, 1024, 80)])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_the_emulation_equals_the_cpu_kernel(
    rowwise: bool, m: int, k: int, n: int, a_dtype: torch.dtype, out_dtype: torch.dtype, fast_accum: bool
) -> None:
    a8, b8, scale_a, scale_b = _rowwise_operands(m, k, n, a_dtype, rowwise)
    inverse_a, inverse_b = scale_a.reciprocal(), scale_b.reciprocal()
    native = torch._scaled_mm(
        a8, b8, scale_a=inverse_a, scale_b=inverse_b, out_dtype=out_dtype, use_fast_accum=fast_accum
    )
    assert_bitwise_equal(emulated_scaled_mm(a8, b8, inverse_a, inverse_b, out_dtype), native)


@pytest.mark.parametrize("role", list(Gemm))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 37])  # one row: a (1, 1) scale_a, still rowwise
def test_fp8_mm_emulates_rowwise_scales_where_the_cpu_kernel_lacks_them(
    monkeypatch: pytest.MonkeyPatch, role: Gemm, out_dtype: torch.dtype, m: int
) -> None:
    a8, b8, scale_a, scale_b = _rowwise_operands(m, 64, 48, E4M3, rowwise=True)
    expected = emulated_scaled_mm(a8, b8, scale_a.reciprocal(), scale_b.reciprocal(), out_dtype)
    monkeypatch.setattr(_compat, "native_rowwise_scaled_mm", lambda device: False)
    assert_bitwise_equal(fp8_mm(a8, b8, scale_a, scale_b, out_dtype, role), expected)
