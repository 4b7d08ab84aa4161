"""The user's DistributedDataParallel beside amp8: ``amp8.distributed.register_ddp`` (and the
error where it was not called), and ``fp8_compress_hook``'s asynchronous buckets, measured
on two CPU processes over gloo."""

# No ``from __future__ import annotations``: DDP checks its comm hooks' annotations as objects.
import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import amp8
from amp8.distributed import (
    DataParallelGroup, fp8_all_reduce_mean, fp8_compress_hook, register_ddp, register_ddp_when_wrapped,
)
from amp8.distributed.ddp import running_ddp
from amp8.distributed.ddp_watch import tensors_in
from conftest import assert_bitwise_equal
from multiprocess import run

DDP = nn.parallel.DistributedDataParallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _initialized(level: str = "O2", **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, **options)


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    ddp(torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    optimizer.step()


def _error(action: Callable[[], Any]) -> str:
    """The message of the exception ``action`` raises ("" when it raises none)."""
    try:
        action()
    except (RuntimeError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


# -- one process -------------------------------------------------------------------------
def test_register_ddp_takes_a_distributed_data_parallel_only() -> None:
    model, _ = _initialized()
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.parallel\.DistributedDataParallel, got Sequential"):
        register_ddp(model)  # type: ignore[arg-type]


def test_no_ddp_runs_a_model_called_directly() -> None:
    model = _model()
    assert running_ddp(model) is None


def test_tensors_in_finds_the_tensors_of_nested_outputs() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    found = tensors_in({"loss": a, "parts": (b, [c, "text"]), "count": 3})
    assert [t.item() for t in found] == [0.0, 1.0, 2.0]


# -- two processes: registration ------------------------------------------------------------
def _counting_hook(calls: list[int]) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future().then(
            lambda future: future.value()[0]
        )
    return hook


def _registration(rank: int, world: int) -> dict[str, Any]:
    """Each way of putting a DDP around an amp8 model, and what it gives."""
    found: dict[str, Any] = {}
    model, optimizer = _initialized()
    ddp = DDP(model)
    found["unregistered"] = _error(lambda: ddp(torch.randn(4, 32)))
    found["returned"] = register_ddp(ddp) is ddp and register_ddp(ddp) is ddp  # a second call does nothing
    found["trains_once_registered"] = _error(lambda: _step(ddp, optimizer, seed=rank)) == ""
    found["comm_hook_registered"] = bool(ddp._comm_hooks)

    model, optimizer = _initialized()
    own = DDP(model)
    calls: list[int] = []
    own.register_comm_hook(None, _counting_hook(calls))
    found["second_hook"] = _error(lambda: register_ddp(own))
    register_ddp(own, comm_hook=False)
    stats = amp8.distributed.data_parallel_group(model).stats
    _step(own, optimizer, seed=10 + rank)
    found["own_hook_calls"] = len(calls)
    found["own_hook_fp8_bytes"] = dict(stats.bytes_by_kind)
    found["own_hook_state"] = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith(("scale", "amax_history"))}

    model, optimizer = _initialized()
    model._ddp_params_and_buffers_to_ignore = []  # the user replaced amp8's list before wrapping
    found["not_left_to_amp8"] = _error(lambda: register_ddp(DDP(model)))

    model, optimizer = _initialized(module_filter=lambda module, name: False)  # no FP8 layer at all
    plain = DDP(model)
    found["no_fp8_layer_unregistered"] = _error(lambda: plain(torch.randn(4, 32)))
    found["no_fp8_layer_optimizer"] = _error(lambda: register_ddp(plain, torch.optim.SGD(model.parameters())))
    register_ddp(plain, optimizer)
    found["no_fp8_layer_trains"] = _error(lambda: _step(plain, optimizer, seed=20 + rank)) == ""

    # A trainer wraps the model, or a module holding it (Lightning's LightningModule), itself.
    explicit_model, explicit_optimizer = _initialized()
    explicit = register_ddp(DDP(explicit_model))
    for name, wrap in (("model", lambda net: net), ("holder", _Holder)):
        model, optimizer = _initialized()
        wrapped = register_ddp_when_wrapped(wrap(model))
        late = DDP(wrapped)
        group = amp8.distributed.data_parallel_group(model)
        found[f"{name}_unregistered_before_forward"] = group.ddp is None
        _step(late, optimizer, seed=30 + rank)
        found[f"{name}_registered_at_first_forward"] = group.ddp is late and bool(late._comm_hooks)
        found[f"{name}_state"] = {k: v.clone() for k, v in model.state_dict().items()}
    _step(explicit, explicit_optimizer, seed=30 + rank)
    found["explicit_state"] = {k: v.clone() for k, v in explicit_model.state_dict().items()}

    model, optimizer = _initialized("O3", recipe=amp8.Recipe())
    found["o3_when_wrapped"] = _error(lambda: register_ddp_when_wrapped(model))
    sharded = DDP(model)
    found["o3_register"] = _error(lambda: register_ddp(sharded))
    found["o3_forward"] = _error(lambda: sharded(torch.randn(4, 32)))
    return found


class _Holder(nn.Module):
    """A module that holds the amp8 model, as a LightningModule does."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.fixture(scope="module")
def registration(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_registration, tmp_path_factory.mktemp("registration"))


@pytest.mark.multiprocess
def test_unregistered_ddp_fails_at_the_first_forward_naming_register_ddp(registration: list[dict]) -> None:
    for rank in registration:
        assert rank["unregistered"].startswith("RuntimeError: a DistributedDataParallel runs this amp8 model")
        assert "amp8.distributed.register_ddp(ddp) in every process after wrapping" in rank["unregistered"]


@pytest.mark.multiprocess
def test_registered_ddp_trains_with_amp8s_comm_hook(registration: list[dict]) -> None:
    for rank in registration:
        assert rank["returned"], "register_ddp returns the DDP, and a second call changes nothing"
        assert rank["trains_once_registered"]
        assert rank["comm_hook_registered"], "register_ddp registers fp8_compress_hook by default"


@pytest.mark.multiprocess
def test_comm_hook_false_keeps_the_users_hook(registration: list[dict]) -> None:
    first, second = registration
    assert "DDP takes one comm hook" in first["second_hook"] and "comm_hook=False" in first["second_hook"]
    assert first["own_hook_calls"] >= 1, "the user's hook reduces the other parameters"
    assert first["own_hook_fp8_bytes"]["all_to_all"] > 0, "amp8 reduces the FP8 weights"
    for key, value in first["own_hook_state"].items():
        assert torch.equal(second["own_hook_state"][key], value), key


@pytest.mark.multiprocess
def test_ddp_that_does_not_leave_fp8_weights_to_amp8_is_refused(registration: list[dict]) -> None:
    message = registration[0]["not_left_to_amp8"]
    assert "does not leave '0.weight' to amp8" in message and "wrap the model it returned itself" in message


@pytest.mark.multiprocess
def test_model_without_fp8_layers_registers_through_its_optimizer(registration: list[dict]) -> None:
    rank = registration[0]
    assert "register_ddp(ddp, optimizer)" in rank["no_fp8_layer_unregistered"]
    assert "optimizer must be the one amp8.initialize returned" in rank["no_fp8_layer_optimizer"]
    assert rank["no_fp8_layer_trains"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("wrapped", ["model", "holder"])
def test_a_ddp_a_trainer_builds_is_registered_at_its_first_forward(registration: list[dict], wrapped: str) -> None:
    first, second = registration
    for rank in registration:
        assert rank[f"{wrapped}_unregistered_before_forward"]
        assert rank[f"{wrapped}_registered_at_first_forward"], "registered, with amp8's comm hook"
    for key, value in first[f"{wrapped}_state"].items():
        if not key.endswith(("scale", "amax_history")):  # the inputs' scales are each rank's own
            assert torch.equal(second[f"{wrapped}_state"][key], value), f"ranks differ in {key}"
        for rank in registration:
            assert torch.equal(rank["explicit_state"][key], rank[f"{wrapped}_state"][key]), f"{key}: not register_ddp's"


@pytest.mark.multiprocess
def test_ddp_around_an_o3_model_is_refused(registration: list[dict]) -> None:
    for key in ("o3_register", "o3_forward", "o3_when_wrapped"):
        assert "sharded with FSDP2" in registration[0][key] and "O1/O2 under DDP" in registration[0][key]


# -- two processes: the asynchronous comm hook --------------------------------------------
def _synchronous_hook(state: DataParallelGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``fp8_compress_hook`` as it was before it became asynchronous: the reference."""
    buffer = bucket.buffer()
    (mean,) = fp8_all_reduce_mean([buffer.float()], state.group, state.stats)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(mean.to(buffer.dtype).view_as(buffer))
    return future


def _overlap(rank: int, world: int, state_kind: str) -> dict[str, Any]:
    """Four layers in four DDP buckets, averaged by ``fp8_compress_hook`` and by the
    synchronous reference, with a log of hook calls and gradients as backward runs."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    reference = copy.deepcopy(net)
    log: list[tuple[Any, ...]] = []
    futures: dict[int, torch.futures.Future] = {}
    group = DataParallelGroup()

    def observed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        log.append(("call", bucket.index(), [future.done() for future in futures.values()]))
        future = fp8_compress_hook(state, bucket)
        futures[bucket.index()] = future
        log.append(("return", bucket.index(), future.done(), bucket.is_last()))
        return future

    for param in net.parameters():
        param.register_post_accumulate_grad_hook(lambda param: log.append(("grad",)))
    ddp = DDP(net, bucket_cap_mb=0.01)  # one layer per bucket
    ddp.register_comm_hook(group if state_kind == "group" else None, observed)
    reference_group = DataParallelGroup()
    ddp_reference = DDP(reference, bucket_cap_mb=0.01)
    ddp_reference.register_comm_hook(reference_group, _synchronous_hook)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):  # DDP rebuilds its buckets after the first backward
        log.clear()
        futures.clear()
        x = torch.randn(16, 64, generator=generator)
        net.zero_grad()
        reference.zero_grad()
        ddp(x).pow(2).sum().backward()
        ddp_reference(x).pow(2).sum().backward()
    return {
        "log": log, "grads": [p.grad.clone() for p in net.parameters()],
        "reference": [p.grad.clone() for p in reference.parameters()],
        "bytes": dict(group.stats.bytes_by_kind), "reference_bytes": dict(reference_group.stats.bytes_by_kind),
    }


@pytest.fixture(scope="module")
def overlap(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_overlap, tmp_path_factory.mktemp("overlap"), "group")


@pytest.mark.multiprocess
def test_async_hook_gives_the_synchronous_bits_on_every_rank(overlap: list[dict]) -> None:
    first, second = overlap
    for mine, theirs, expected in zip(first["grads"], second["grads"], first["reference"]):
        assert_bitwise_equal(mine, theirs)
        assert_bitwise_equal(mine, expected)


@pytest.mark.multiprocess
def test_async_hook_sends_the_bytes_of_the_synchronous_one(overlap: list[dict]) -> None:
    first = overlap[0]
    assert first["bytes"] == first["reference_bytes"], (first["bytes"], first["reference_bytes"])
    # Three backward passes over four 64 x 64 layers with biases: half of every gradient
    # crosses in each collective, one byte per element, plus a float32 scale per bucket.
    half = 3 * 4 * (64 * 64 + 64) // 2
    sent = first["bytes"]
    assert sent["all_to_all"] == sent["all_gather"] and half <= sent["all_to_all"] <= half + 3 * 4 * 4, sent


@pytest.mark.multiprocess
def test_async_hook_returns_before_its_bucket_is_averaged(overlap: list[dict]) -> None:
    """DDP goes on with backward while a bucket is on the wire: the hook returns a future
    not yet completed, and gradients of the next layers are computed before it is. (The
    last bucket returns with its all-gather started, which may be done by then.)"""
    for rank in overlap:
        log = rank["log"]
        returns = [event for event in log if event[0] == "return"]
        assert len(returns) == 4, f"one bucket per layer expected, got {len(returns)}"
        assert [event[3] for event in returns] == [False, False, False, True], returns
        assert not any(event[2] for event in returns[:-1]), f"a future was complete at return: {returns}"
        for index, event in enumerate(log):
            if event[0] == "return" and not event[3]:
                following = log[index + 1 :]
                next_call = next(e for e in following if e[0] == "call")
                assert ("grad",) in following[: following.index(next_call)], "backward ran on in between"
                assert not next_call[2][event[1]], "the bucket was still on the wire when the next came"


@pytest.mark.multiprocess
def test_async_hook_with_a_process_group_as_state(tmp_path: Path) -> None:
    """With no DataParallelGroup to keep a bucket in, each call finishes its own; the
    values are the same."""
    first, second = run(_overlap, tmp_path, "process group")
    for mine, theirs, expected in zip(first["grads"], second["grads"], first["reference"]):
        assert_bitwise_equal(mine, theirs)
        assert_bitwise_equal(mine, expected)
