"""The precision report as a heatmap: its cells, and the PNG."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import amp8
from amp8.monitor.report_plot import heatmap_cells


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(depth))
        self.head = nn.Linear(32, 10)  # 10 outputs: kept in high precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _report(depth: int, watch: bool) -> amp8.monitor.PrecisionReport:
    torch.manual_seed(0)
    model = _Net(depth)
    model, optimizer = amp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe=amp8.Recipe())
    with amp8.watch_operands(model) if watch else torch.enable_grad():
        model(torch.randn(16, 32)).pow(2).mean().backward()
    optimizer.step()
    return amp8.report(model, optimizer)


def test_cells_are_blocks_by_roles_and_tensors_with_the_high_layers_marked() -> None:
    report = _report(3, watch=True)
    cells = heatmap_cells(report.rows, "sqnr")
    assert cells["rows"] == ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert cells["columns"][:4] == ["up input", "up weight", "up grad output", "up weight gradient"]
    assert len(cells["columns"]) == 12
    up_input = next(row for row in report.rows if row.name == "blocks.1.up.weight").operands
    assert cells["values"][1][0] == min(v["sqnr_db"] for k, v in up_input.items() if k.endswith("input"))
    assert cells["high"] == [(3, 8), (3, 9), (3, 10), (3, 11)] and all(math.isnan(v) for v in cells["values"][3])
    health = heatmap_cells(report.rows, "health")
    assert all(0 <= value <= 100 for row in health["values"][:3] for value in row[:8])


def test_without_watched_operands_the_cells_are_the_weights_casts() -> None:
    report = _report(2, watch=False)
    cells = heatmap_cells(report.rows, "health")
    assert cells["columns"] == ["up", "down", "layer"]
    row = next(row for row in report.rows if row.name == "blocks.0.down.weight")
    assert cells["values"][0][1] == 100 * max(row.underflow, row.saturated)
    with pytest.raises(ValueError, match="watch_operands"):
        report.plot("unused.png", by="sqnr")
    with pytest.raises(ValueError, match="by='size'"):
        heatmap_cells(report.rows, "size")


@pytest.mark.parametrize("depth", [2, 80])
def test_the_png_is_written_for_a_shallow_and_a_deep_model(tmp_path: Path, depth: int) -> None:
    pytest.importorskip("matplotlib")
    path = _report(depth, watch=True).plot(tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
