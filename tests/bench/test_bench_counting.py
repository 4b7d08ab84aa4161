"""bench/counting.py: what the counter counts of eager operations, host scalars and syncs,
and of compiled graphs; every dispatched operation."""

from __future__ import annotations

import pytest
import torch

import amp8
from conftest import load_bench

counting = load_bench("counting")


def _scale_and_bump(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y.add_(1)  # written in place: read and written by the graph
    return x * 2, (x + y).amax()


_compiled_scale_and_bump = torch.compile(_scale_and_bump, fullgraph=True, dynamic=True)


@pytest.mark.parametrize("n", [8, 40])
@pytest.mark.parametrize("calls", [1, 3])
def test_counter_counts_compiled_graph_calls_and_their_bytes(n: int, calls: int) -> None:
    """Each call of a compiled graph is counted with the bytes its kernels move, at least
    its inputs and outputs once each; what runs inside it is not counted again as eager
    operations."""
    x, y = torch.randn(n), torch.randn(n)
    _compiled_scale_and_bump(x, y)  # compiled outside the count
    counter = counting.StepCounter()
    with counter, counter.phase("optimizer"):
        for _ in range(calls):
            _compiled_scale_and_bump(x, y)
        x.mul_(3)  # one eager operation beside the graphs
    row = counter.totals()["optimizer"]
    assert row["graph_calls"] == calls, row
    assert calls * 4 * (n + n + n + 1) <= row["graph_bytes"] <= calls * 4 * 3 * (n + n + n + 1), row  # x, y; 2x, amax
    assert row["graph_kernels"] >= calls, row
    assert row["ops"] == 1 and row["bytes"] == 4 * 2 * n, row


@pytest.mark.parametrize("level", ["O1"])
def test_counter_counts_the_compiled_low_bit_adam_step(level: str) -> None:
    """LowBitAdam's compiled step is seen as graph calls (however it groups the
    parameters) that read and write at least its moments and weights once each."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False))
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level,
                                       layer_selection="all")
    fused = amp8.optim.LowBitAdam.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), optimizer.level,
                                                 fused=True)
    model(torch.randn(4, 32)).sum().backward()
    fused.step()  # compiles
    counter = counting.StepCounter()
    with counter, counter.phase("optimizer"):
        fused.step()
    row = counter.totals()["optimizer"]
    state = sum(t.nbytes for s in fused.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
    weights = sum(handle.data.nbytes for handle in fused.weights.values())
    assert 1 <= row["graph_calls"] <= 2, row
    assert row["graph_bytes"] >= 2 * (state + weights), (row, state, weights)


@pytest.mark.parametrize("m, k, n", [(4, 8, 16), (32, 16, 8)])
def test_counter_counts_a_matmul_and_skips_views(m: int, k: int, n: int) -> None:
    a, b = torch.randn(m, k), torch.randn(k, n)
    counter = counting.StepCounter()
    with counter, counter.phase("forward"):
        (a.t().t() @ b.view(k, n)).view(-1)
    row = counter.counts["forward"]
    assert row["ops"] == 1 and row["other_flops"] == 2 * m * k * n and row["fp8_flops"] == 0, row
    assert row["bytes"] == 4 * (m * k + k * n + m * n), row


def test_counter_reads_of_host_scalars_are_no_syncs() -> None:
    """A read of the optimizer's CPU step count neither syncs nor launches a kernel; a read
    of a value computed on the device syncs and ends the phase's stretch."""
    step, x = torch.zeros(()), torch.randn(8)
    counter = counting.StepCounter([step])
    with counter, counter.phase("optimizer"):
        step += 1
        float(step)  # a host read
        if bool((x * 2).sum() > 0):  # a device read: three kernels, then the sync
            pass
        x.mul_(3)
    first, second = counter.stretches["optimizer"]
    assert (first["ops"], first["host_ops"], first["syncs"]) == (3, 1, 1), first
    assert (second["ops"], second["host_ops"], second["syncs"]) == (1, 0, 0), second
    assert counter.totals()["optimizer"]["syncs"] == 1


def test_counter_dispatches_every_operation_and_a_graph_call_as_one() -> None:
    """``dispatched_operations`` counts what a step dispatches, in a phase or not: views and
    kernels alike, and a compiled graph's call as one, not the operations inside it."""
    x, y = torch.randn(8), torch.randn(8)
    _compiled_scale_and_bump(x, y)  # compiled outside the count

    def eager() -> None:
        x.view(2, 4).t().mul(2)

    def with_graph() -> None:
        eager()
        _compiled_scale_and_bump(x, y)

    assert counting.dispatched_operations(eager) == 3
    assert counting.dispatched_operations(with_graph) == 4
