"""``amp8.export`` and ``copy.deepcopy`` of an amp8 model in a process group: on two CPU
processes over gloo at O1 and O2, the model alone, wrapped in a DistributedDataParallel,
and with that DDP registered (``register_ddp``); O3's sharded weights are refused by name.
The one-process tests build the same copies from a guard holding a stand-in process group."""

# No ``from __future__ import annotations``: DDP checks its comm hooks' annotations as objects.
import copy
import gc
import threading
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import amp8
from amp8 import Recipe
from amp8.config.levels import Precision
from amp8.tensor.scaled_weight import ScaledWeight
from amp8.distributed import DataParallelGroup, register_ddp, register_ddp_when_wrapped
from amp8.distributed.ddp import DdpGuard, data_parallel_group, guard_ddp
from amp8.nn import Fp8Linear
from amp8.nn.experts import Fp8Experts
from amp8.nn.embedding import LowBitEmbedding
from amp8.nn.stored_weights import StoredWeightsBase
from amp8.optim import LowBitAdam
from amp8.tensor.stored import stored_weight
from conftest import assert_bitwise_equal
from moe_models import TinyExperts
from multiprocess import run

DDP = nn.parallel.DistributedDataParallel
LEVELS = ("O1", "O2")
CASES = ("alone", "wrapped", "registered")  # no DDP; a DDP not yet registered; a registered one
PROCESS_GROUP_OBJECTS = (dist.ProcessGroup, DataParallelGroup, DDP, LowBitAdam)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 16))


def _initialized(level: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)


def _input(seed: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    model(_input(seed)).pow(2).mean().backward()
    optimizer.step()


def _error(action: Callable[[], Any]) -> str:
    """The message of the exception ``action`` raises ("" when it raises none)."""
    try:
        action()
    except (RuntimeError, TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _reachable(root: object, kinds: tuple[type, ...]) -> list[str]:
    """The type names of the objects of ``kinds`` that ``root`` refers to, directly or
    through other objects (attributes, containers, bound methods, closures; not through
    classes, modules or a function's globals)."""
    seen: set[int] = set()
    stack, found = [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.CodeType, types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(type(obj).__name__)
        if isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ())
        else:
            stack.extend(gc.get_referents(obj))
    return found


def _shared_storage(copied: nn.Module, original: nn.Module) -> list[str]:
    """Names of the copy's parameters and buffers that share storage with the original's
    (an FP8 layer's weight: its stored tensor)."""
    def address(tensor: torch.Tensor) -> int:
        return (tensor.stored().data if isinstance(tensor, ScaledWeight) else tensor).untyped_storage().data_ptr()
    pointers = {address(t) for t in [*original.parameters(), *original.buffers()]}
    named = [*copied.named_parameters(), *copied.named_buffers()]
    return [name for name, t in named if address(t) in pointers]


def _unbound_handles(model: nn.Module) -> list[str]:
    """FP8 layers whose weight's handle is not the layer's own, or reads another Parameter."""
    return [name for name, layer in model.named_modules() if isinstance(layer, Fp8Linear)
            and not (stored_weight(layer.weight) is layer.stored_weight and layer.stored_weight.param is layer.weight)]


def _export_checks(model: nn.Module, ddp: nn.Module | None) -> dict[str, Any]:
    exported = amp8.export(model)
    found: dict[str, Any] = {
        "model_state": _state(model),
        "export_state": _state(exported),
        "export_amp8_modules": [name for name, m in exported.named_modules() if isinstance(m, StoredWeightsBase)],
        "export_hooks": [name for name, m in exported.named_modules() if m._forward_pre_hooks],
        "export_reaches": _reachable(exported, PROCESS_GROUP_OBJECTS),
        # Exact: export reads the stored weight as read_weight does, in float32.
        "export_not_real": [name for name, layer in model.named_modules() if isinstance(layer, Fp8Linear)
                            and not torch.equal(exported.get_submodule(name).weight, layer.read_weight())],
    }
    if ddp is not None:
        through_ddp = _state(amp8.export(ddp))
        exported_state = found["export_state"]
        found["export_of_ddp_differs"] = [k for k, v in exported_state.items() if not torch.equal(through_ddp[k], v)]
    return found


def _copy_checks(
    model: nn.Module, optimizer: torch.optim.Optimizer, ddp: nn.Module | None, trained: nn.Module, seed: int,
) -> dict[str, Any]:
    """Copy the model (and the DDP, if any), then train the original one step through ``trained``."""
    copied = copy.deepcopy(model)
    x = _input(100 + seed)
    with torch.no_grad():
        copy_output, model_output = copied(x), model(x)
    found: dict[str, Any] = {
        "copy_forward": (copy_output, model_output),
        "copy_shared_storage": _shared_storage(copied, model),
        "copy_unbound_handles": _unbound_handles(copied),
        "copy_group": data_parallel_group(copied),
        "copy_reaches": _reachable(copied, PROCESS_GROUP_OBJECTS),
        "original_reaches": _reachable(model, PROCESS_GROUP_OBJECTS),
        "original_group_kept": data_parallel_group(model) is optimizer.gradient_average.data_parallel,
    }
    if ddp is not None:
        copied_ddp = copy.deepcopy(ddp)
        with torch.no_grad():
            found["copied_ddp_forward"] = (copied_ddp(x), model_output)
        found["copied_ddp_unbound_handles"] = _unbound_handles(copied_ddp.module)
    before, copy_before = _state(model), _state(copied)
    _step(trained, optimizer, seed)
    found["original_changed"] = [k for k, v in _state(model).items() if not torch.equal(before[k], v)]
    found["copy_changed"] = [k for k, v in _state(copied).items() if not torch.equal(copy_before[k], v)]
    with torch.no_grad():
        found["copy_forward_after"] = (copied(x), copy_output)
    found["copied"] = copied
    return found


def _copies(rank: int, world: int) -> dict[str, Any]:
    """Each level and case: the export and the copies, checked where they are made."""
    found: dict[str, Any] = {}
    for level in LEVELS:
        for case in CASES:
            model, optimizer = _initialized(level)
            _step(model, optimizer, seed=rank)  # each rank its own batch: the weights are the average
            ddp = None if case == "alone" else DDP(model)
            trained = model  # an unregistered DDP refuses to train: the model trains alone
            if case == "registered":
                trained = register_ddp(ddp)
                _step(trained, optimizer, seed=10 + rank)
            checks = {**_export_checks(model, ddp), **_copy_checks(model, optimizer, ddp, trained, seed=20 + rank)}
            copied = checks.pop("copied")
            if case == "registered":  # a DDP around the copy: no optimizer averages its gradients
                around_copy = DDP(copied)
                checks["copy_register"] = _error(lambda: register_ddp(around_copy))
                checks["copy_forward_under_ddp"] = _error(lambda: around_copy(_input(0)))
            found[level, case] = checks
    model, optimizer = _initialized("O3")
    found["O3", "export"] = _error(lambda: amp8.export(model))
    return found


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_copies, tmp_path_factory.mktemp("copies"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", LEVELS)
def test_export_holds_the_real_weights_on_every_rank(copies: list[dict], level: str, case: str) -> None:
    for rank in copies:
        found = rank[level, case]
        assert found["export_not_real"] == [], "exported weights differ from the stored weights' real values"
        assert found["export_amp8_modules"] == [] and found["export_hooks"] == [], "export is a plain model"
        assert found["export_reaches"] == [], "the export holds no process group, DDP or optimizer"
        if case != "alone":
            assert found["export_of_ddp_differs"] == [], "export(ddp) exports the model the DDP wraps"
    first, second = (rank[level, case]["export_state"] for rank in copies)
    for key, value in first.items():
        assert_bitwise_equal(second[key], value)  # the ranks hold the same weights


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", LEVELS)
def test_export_equals_the_export_of_one_process(copies: list[dict], level: str, case: str) -> None:
    """A model in one process loaded from a rank's state exports what that rank exported."""
    found = copies[0][level, case]
    model, _ = amp8.initialize(_model(), None, level)
    model.load_state_dict(found["model_state"])
    one_process = _state(amp8.export(model))
    assert set(one_process) == set(found["export_state"])
    for key, value in one_process.items():
        assert_bitwise_equal(found["export_state"][key], value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", LEVELS)
def test_deepcopy_is_a_usable_independent_model(copies: list[dict], level: str, case: str) -> None:
    for rank in copies:
        found = rank[level, case]
        assert_bitwise_equal(*found["copy_forward"])
        assert found["copy_shared_storage"] == [], "the copy must own its tensors"
        assert found["copy_unbound_handles"] == [], "each copied layer stores its weight through its own handle"
        assert found["original_changed"], "the original trained (else the next check proves nothing)"
        assert found["copy_changed"] == [], "training the original changed the copy"
        assert_bitwise_equal(*found["copy_forward_after"])
        if case != "alone":
            assert_bitwise_equal(*found["copied_ddp_forward"])
            assert found["copied_ddp_unbound_handles"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", LEVELS)
def test_deepcopy_holds_no_process_group(copies: list[dict], level: str, case: str) -> None:
    for rank in copies:
        found = rank[level, case]
        assert found["copy_group"] is None and found["copy_reaches"] == []
        assert found["original_group_kept"], "the original keeps its group"
        assert "DataParallelGroup" in found["original_reaches"], "the walk finds what the original holds"
        if case == "registered":
            assert {"ProcessGroup", "DistributedDataParallel"} <= set(found["original_reaches"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("level", LEVELS)
def test_ddp_around_a_copy_is_refused(copies: list[dict], level: str) -> None:
    for rank in copies:
        found = rank[level, "registered"]
        for key in ("copy_register", "copy_forward_under_ddp"):
            assert found[key].startswith("RuntimeError: DistributedDataParallel wraps a copy (copy.deepcopy)"), key
            assert "amp8.export(model)" in found[key]


@pytest.mark.multiprocess
def test_export_of_sharded_o3_is_still_refused_by_name(copies: list[dict]) -> None:
    for rank in copies:
        assert rank["O3", "export"].startswith("ValueError: 0.weight is sharded over data-parallel ranks")


# -- one process: the same copies, from a guard holding a stand-in process group ------------
class _Uncopyable:
    """Stands in for a ``ProcessGroup``, which neither copies nor pickles."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


@pytest.mark.parametrize("registered", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_copy_of_a_guarded_model_holds_no_group(level: str, registered: bool) -> None:
    model, _ = amp8.initialize(_model(), None, level)
    group = DataParallelGroup(group=_Uncopyable())  # type: ignore[arg-type]
    if registered:  # as register_ddp leaves it
        group.ddp = _Uncopyable()
    guard_ddp(model, group)
    copied = copy.deepcopy(model)
    assert data_parallel_group(model) is group and data_parallel_group(copied) is None
    assert _reachable(copied, (_Uncopyable, DataParallelGroup)) == []
    assert len(_reachable(model, (_Uncopyable,))) == 1 + registered, "the walk finds what the original holds"
    guards = [hook.__self__ for hook in copied._forward_pre_hooks.values() if isinstance(hook.__self__, DdpGuard)]
    assert len(guards) == 1 and guards[0].data_parallel is None
    with pytest.raises(RuntimeError, match=r"wraps a copy \(copy\.deepcopy\) of an amp8 model"):
        register_ddp_when_wrapped(copied)
    x = _input(0)
    with torch.no_grad():
        assert_bitwise_equal(copied(x), model(x))
    assert _shared_storage(copied, model) == []


def test_data_parallel_group_is_shared_by_copies() -> None:
    group = DataParallelGroup(group=_Uncopyable())  # type: ignore[arg-type]
    assert copy.deepcopy(group) is group
    assert copy.deepcopy({"state": group})["state"] is group


STORED_MODULES: dict[str, Callable[[Precision], StoredWeightsBase]] = {
    "linear": lambda storage: Fp8Linear.from_linear(nn.Linear(32, 16), Recipe(), storage),
    "embedding": lambda storage: LowBitEmbedding.from_embedding(nn.Embedding(16, 32), Recipe()),  # FP16 only
    "experts": lambda storage: Fp8Experts.from_module(TinyExperts(), Recipe(), storage),
}


@pytest.mark.parametrize("handle_first", [True, False])
@pytest.mark.parametrize(("kind", "storage"), [
    ("linear", Precision.FP16), ("linear", Precision.FP8), ("embedding", Precision.FP16),
    ("experts", Precision.FP16), ("experts", Precision.FP8),
])
def test_copy_reaching_stored_weights_before_their_module(kind: str, storage: Precision, handle_first: bool) -> None:
    """Whichever of a module and its stored-weight handles a copy reaches first (the
    optimizer's gradient reduction holds the handles), each copied handle serves the
    copied module."""
    module = STORED_MODULES[kind](storage)
    handles = module.stored_weights()
    if handle_first:
        *copied_handles, copied = copy.deepcopy((*handles, module))
    else:
        copied, *copied_handles = copy.deepcopy((module, *handles))
    assert list(copied.stored_weights()) == copied_handles
    for handle, twin in zip(handles, copied_handles):
        assert twin is not handle and twin.storage is handle.storage
        assert twin.param is getattr(copied, handle.name) and stored_weight(twin.param) is twin
        assert_bitwise_equal(twin.read(), handle.read())
        twin.write(torch.zeros_like(twin.read()))
        assert handle.read().abs().sum() > 0, "writing the copy changed the original"
