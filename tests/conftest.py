"""Shared fixtures and numerics asserts for amp8's tests."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

# pytest-xdist runs the suite in one worker per core (pyproject.toml's ``-n auto``). Each
# worker, and every process it starts, takes one thread: with torch's default of a thread
# per core in every worker, idle threads spin against each other and the suite runs
# several times slower.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
from torch import nn

import amp8
from amp8 import Recipe
from amp8.nn import Fp8Linear
from amp8.quant.scaling import sqnr

if XDIST_WORKER:
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]  # the repository
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"
STUDIES = ROOT / "studies"


# Files whose every test is of one kind, marked here rather than in the file.
FILE_MARKERS = {"test_data_parallel.py": ("multiprocess",)}  # every test runs on two processes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("slow_markers", "markers that put a test outside the fast tier (-m 'not slow')", type="args")


SHOW_FAILURES_AT_ONCE = "AMP8_SHOW_FAILURES_AT_ONCE"


class FailuresAtOnce:
    """Prints each failure's traceback as the test ends (pytest prints them only at the
    end of the run), so that a run its time limit cuts off, as ``bench/run_gpu.sh``'s CUDA
    tests can be, still says why its tests failed."""

    def __init__(self, terminal: Any) -> None:
        self.terminal = terminal

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Print ``report``'s traceback where it is a failure."""
        if report.failed:
            self.terminal.write_line(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists
def pytest_configure(config: pytest.Config) -> None:
    """With ``AMP8_SHOW_FAILURES_AT_ONCE=1``, ``FailuresAtOnce`` (in the process that
    reports: under pytest-xdist the controller, not its workers)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get(SHOW_FAILURES_AT_ONCE) == "1" and not XDIST_WORKER and terminal is not None:
        config.pluginmanager.register(FailuresAtOnce(terminal), "amp8-failures-at-once")


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that carries one of pyproject.toml's ``slow_markers``: the
    fast tier, ``-m "not slow"``, leaves them out."""
    slow_markers = set(config.getini("slow_markers"))
    for item in items:
        for name in FILE_MARKERS.get(item.path.name, ()):
            item.add_marker(name)
        if any(item.get_closest_marker(name) for name in slow_markers) and not item.get_closest_marker("slow"):
            item.add_marker("slow")


@pytest.fixture(autouse=True)
def fixed_seed() -> None:
    """Every test starts from the same random state."""
    torch.manual_seed(0)


def assert_sqnr_at_least(reference: torch.Tensor, approximation: torch.Tensor, floor_db: float) -> float:
    """Assert the SQNR of ``approximation`` against ``reference`` is >= ``floor_db``."""
    measured = sqnr(reference, approximation)
    assert measured >= floor_db, f"SQNR {measured:.2f} dB is below the {floor_db} dB floor"
    return measured


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert two tensors have the same dtype, shape and bits."""
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype.is_floating_point and actual.element_size() == 1:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


_needs_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 tensor cores (sm_89+); the CPU tests cover the same logic",
)


def cuda_fp8(test: Any) -> Any:
    """Mark a test as CUDA-only (``pytest -m cuda`` selects them), skipped without an FP8 GPU."""
    return pytest.mark.cuda(_needs_fp8_gpu(test))


def mlp(*widths: int, bias: bool = True, seed: int | None = 0) -> nn.Sequential:
    """``nn.Linear`` layers through ``widths`` with a GELU between each two, e.g.
    ``mlp(32, 64, 16)``: Linear(32, 64), GELU, Linear(64, 16). Built after
    ``torch.manual_seed(seed)``, or from the random state as it is when ``seed`` is None."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for in_features, out_features in zip(widths, widths[1:]):
        if layers:
            layers.append(nn.GELU())
        layers.append(nn.Linear(in_features, out_features, bias=bias))
    return nn.Sequential(*layers)


def linear_pair(
    in_features: int, out_features: int, recipe: Recipe, bias: bool = True
) -> tuple[nn.Linear, Fp8Linear]:
    """An ``nn.Linear`` and an ``Fp8Linear`` holding the same real weight (the one the FP8
    layer stores) and bias."""
    reference = nn.Linear(in_features, out_features, bias=bias)
    layer = Fp8Linear.from_linear(nn.Linear(in_features, out_features, bias=bias), recipe)
    with torch.no_grad():
        reference.weight.copy_(layer.read_weight())
        if bias:
            reference.bias.copy_(layer.bias)
    return reference, layer


def _load_script(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module, with examples/ on the path (as when it
    runs as a script) for the examples it builds on."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return _load_script(EXAMPLES / f"{name}.py", f"example_{name}")


def load_bench(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` as a module, with bench/ on the path for its ``common``."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return _load_script(BENCH / f"{name}.py", f"bench_{name}")


def load_study(name: str) -> ModuleType:
    """Import ``studies/<name>.py`` as a module, with studies/ on the path for the modules
    it builds on (it puts bench/ there itself, for its records)."""
    if str(STUDIES) not in sys.path:
        sys.path.insert(0, str(STUDIES))
    return _load_script(STUDIES / f"{name}.py", f"study_{name}")


def train_steps(model: nn.Module, optimizer: Any, batches: list[torch.Tensor]) -> list[float]:
    """One optimizer step per batch on the loss ``mean(model(x) ** 2)``; the losses."""
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def compact_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` in its compact form: the FP8 layers' weights as stored, with
    their scales and amp8's buffers."""
    with amp8.compact_state_dict(model):
        return model.state_dict()


def resume_from_checkpoint(
    build: Callable[[], tuple[nn.Module, Any]], model: nn.Module, optimizer: Any
) -> tuple[nn.Module, Any]:
    """A fresh ``build()`` restored from ``model``'s compact state dict (amp8's own
    checkpoint: the weights as stored, with their scales and amp8's buffers) and
    ``optimizer``'s, saved with ``torch.save`` and read back with
    ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    with amp8.compact_state_dict(model):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model, resumed_optimizer = build()
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    return resumed_model, resumed_optimizer


def assert_checkpoint_round_trips(
    build: Callable[[], tuple[nn.Module, Any]], model: nn.Module, optimizer: Any
) -> tuple[nn.Module, Any]:
    """``resume_from_checkpoint(build, model, optimizer)``, asserting that every tensor of
    the model's and the optimizer's state came back bit for bit."""
    resumed_model, resumed_optimizer = resume_from_checkpoint(build, model, optimizer)
    with amp8.compact_state_dict(model), amp8.compact_state_dict(resumed_model):
        saved, resumed = model.state_dict(), resumed_model.state_dict()
    for key, value in saved.items():
        assert_bitwise_equal(resumed[key], value)
    for index, param_state in optimizer.state_dict()["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                assert_bitwise_equal(resumed_optimizer.state_dict()["state"][index][key], value)
    return resumed_model, resumed_optimizer
