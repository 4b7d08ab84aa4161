"""The precision report as a picture: a heatmap of GEMM layers by depth and role.

Rows are the model's blocks (``model.layers.7``), in order, then the GEMM layers outside
any block (``lm_head``); columns are the layer roles within a block (``self_attn.q_proj``,
``mlp.down_proj``), each split by the tensors whose casts feed its GEMMs (input,
weight, output gradient) and by its FP8 weight gradient, where the operands were
watched (``amp8.watch_operands``).
A cell is coloured by the worst SQNR of those casts (``by="sqnr"``, dB: darker is
worse) or by the larger of the shares flushed to zero and clipped (``by="health"``: the
weight's own cast where no operand was watched). Layers kept in high precision are grey
cells marked "high"; layers the controller moved are marked "moved".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from amp8.monitor.operand_health import CastTensor, casts_of
from amp8.monitor.report_fold import pattern_of
from amp8.monitor.report_row import ReportRow

BY = ("sqnr", "health")


def _is_gemm_weight(row: ReportRow) -> bool:
    """An FP8 layer's weight, or the weight of a GEMM layer kept in high precision."""
    return row.name.endswith("weight") and len(row.shape) == 2 and (
        row.fp8 or (row.note is not None and row.layer not in ("LowBitEmbedding", "Embedding"))
    )


def _place(name: str) -> tuple[str, str]:
    """(row label, role) of a layer's weight: its block and its role in the block, or
    its own name and role "" for a layer outside any block."""
    pattern, indices = pattern_of(name.removesuffix(".weight"))
    if not indices:
        return name.removesuffix(".weight"), ""
    head, _, tail = pattern.partition("{}")
    block = head + str(indices[0])
    return block, tail.lstrip(".").replace("{}", "*")


def heatmap_cells(rows: list[ReportRow], by: str) -> dict[str, Any]:
    """The heatmap's data: ``rows`` and ``columns`` (labels), ``values`` (a list per row,
    NaN where a cell has no value), ``high`` and ``moved`` (the (row, column) cells so
    marked)."""
    if by not in BY:
        raise ValueError(f"by={by!r} is not one of {BY}")
    layers = [row for row in rows if _is_gemm_weight(row)]
    watched = any(row.operands for row in layers)
    tensors = tuple(CastTensor) if watched else (CastTensor.WEIGHT,)
    blocks: list[str] = []
    roles: list[str] = []
    for row in layers:
        block, role = _place(row.name)
        blocks += [block] if block not in blocks else []
        roles += [role] if role not in roles else []
    columns = [f"{role or 'layer'} {tensor.value}".strip() if watched else (role or "layer")
               for role in roles for tensor in tensors]
    values = [[math.nan] * len(columns) for _ in blocks]
    high: list[tuple[int, int]] = []
    moved: list[tuple[int, int]] = []
    for row in layers:
        block, role = _place(row.name)
        r = blocks.index(block)
        for t, tensor in enumerate(tensors):
            c = roles.index(role) * len(tensors) + t
            if not row.fp8:
                high.append((r, c))
                continue
            if row.moves:
                moved.append((r, c))
            values[r][c] = _value(row, tensor, by)
    return {"rows": blocks, "columns": columns, "values": values, "high": high, "moved": moved}


def _value(row: ReportRow, tensor: CastTensor, by: str) -> float:
    """One cell: the worst SQNR (dB) of the casts of ``tensor``, or the larger share
    flushed or clipped (percent), as ``by`` says."""
    casts = casts_of(row.operands, tensor)
    if by == "sqnr":
        return min((values["sqnr_db"] for values in casts), default=math.nan)
    if casts:
        return 100 * max(max(values["underflow"], values["saturated"]) for values in casts)
    shares = [share for share in (row.underflow, row.saturated) if share is not None]
    return 100 * max(shares) if shares else math.nan


def plot_report(rows: list[ReportRow], path: str | Path, by: str | None = None, title: str = "") -> Path:
    """Draw ``rows`` (``PrecisionReport.rows``) as the heatmap (see the module
    docstring) into the PNG at ``path``; ``by`` is "sqnr" where operands were watched,
    else "health", unless given. Returns the path.

    Raises:
        ModuleNotFoundError: when matplotlib is not installed, saying how to get it.
        ValueError: an unknown ``by``, or "sqnr" without watched operands.
    """
    watched = any(row.operands for row in rows)
    by = by or ("sqnr" if watched else "health")
    if by == "sqnr" and not watched:
        raise ValueError("by='sqnr' needs the operands' health: run a step inside amp8.watch_operands(model) first")
    cells = heatmap_cells(rows, by)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the report's picture needs matplotlib; pip install 'amp8[plot]'") from None
    values = np.array(cells["values"], dtype=float).reshape(len(cells["rows"]), len(cells["columns"]))
    height = min(60.0, max(4.5, 2.5 + 0.22 * len(cells["rows"])))  # room for the labels under few rows
    width = min(30.0, 3.0 + 0.45 * len(cells["columns"]))
    figure, ax = plt.subplots(figsize=(width, height))
    colours = plt.get_cmap("viridis" if by == "sqnr" else "magma_r").copy()
    colours.set_bad("lightgrey")
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=colours, interpolation="nearest")
    figure.colorbar(image, ax=ax, label="worst SQNR of the casts (dB)" if by == "sqnr"
                    else "largest share flushed to zero or clipped (%)")
    size = max(4.0, min(8.0, 200 / max(len(cells["rows"]), len(cells["columns"]))))
    for r, c in cells["high"]:
        ax.text(c, r, "high", ha="center", va="center", fontsize=size, color="black")
    for r, c in cells["moved"]:
        ax.text(c, r, "moved", ha="center", va="center", fontsize=size, color="red")
    ax.set_xticks(range(len(cells["columns"])), cells["columns"], rotation=60, ha="right", fontsize=8)
    step = max(1, len(cells["rows"]) // 40)  # every label up to 40 rows, then every step-th
    ax.set_yticks(range(0, len(cells["rows"]), step), cells["rows"][::step], fontsize=8)
    ax.set_title(title or ("GEMM operands: worst SQNR per layer and tensor" if by == "sqnr"
                           else "FP8 casts: largest share flushed or clipped per layer"))
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
