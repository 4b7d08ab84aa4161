"""Adam's update of many tensors in one pass over flat buffers.

The tensors of one update group (``amp8.optim.update_groups``: one ``UpdateSpec``, one
step count, one device) are stored one after another in the rows of 2-D buffers, one
buffer per stored tensor kind (gradient, each moment, weight): each tensor takes whole
rows of ``width`` elements, its last row padded with zeros (which stay zero: a zero
gradient moves nothing). A scale is either per tensor or per buffer row (one per row of a
matrix, ``width`` = its columns, or per flat block of ``width`` elements).

One pass: every element is read once and written once. Every scale, per tensor or per
row, comes from a bound on the new absolute maximum of what it scales, computed before the
pass from the old one and the gradient's (``amp8.optim.arithmetic.amax_bounds``), and the
pass measures the new maximum of what it stores for the next step (``GroupTensors``'
amaxes and row amaxes), so that no value a store needs waits on a reduction over its
row. The skip on an inf or NaN gradient is a mask on the device (``skip``): a
skipped step writes back what it read.

Stochastic rounding takes each element's noise from its tensor's key and its index in that
tensor (``amp8.quant.noise.update_words``), so every value is computed by the same
operations, from the same inputs, as ``amp8.optim.reference_step`` computes it for the
tensor alone: run eagerly, the results are the reference step's bit for bit.

``adam_group_step`` writes into its input buffers; what is fixed between steps is its
``UpdateSpec``, and everything else is a tensor (or a float eagerly), so one compiled
graph serves every step and every group size.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from amp8._compiled import compile_privately
from amp8.optim.arithmetic import (
    Decay, Hyper, StepScalars, adam_arithmetic, amax_bounds, unless_skipped, weight_bound,
)
from amp8.optim.spec import UpdateSpec, WeightKind
from amp8.quant import noise, scaling
from amp8.quant.codec import Layout

MAX_ELEMENTS = (1 << 31) - 1
"""The most elements a tensor of an update group may hold (int32 element indices)."""


class GroupTensors(NamedTuple):
    """One update group's buffers. Data are (rows, width); a scale is (tensors,) where
    the storage scales per tensor, (rows,) where it scales per row, None where it has
    none; the amaxes are the absolute maxima of what is stored, per tensor."""

    grad: torch.Tensor
    grad_scale: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_scale: torch.Tensor | None
    exp_avg_sq: torch.Tensor
    exp_avg_sq_scale: torch.Tensor | None
    weight: torch.Tensor  # FP16 data, FP16 master, or float32 values
    weight_scale: torch.Tensor | None  # per tensor (FP16 storage)
    amaxes: torch.Tensor  # (3, tensors): what the first moment, second moment and weight store
    row_amaxes: torch.Tensor  # (3, rows): what each row of the first moment, second moment and weight stores
    fp8_weight: torch.Tensor | None  # O3's FP8 weight (WeightKind.MASTER)
    fp8_weight_scale: torch.Tensor | None
    row_tensor: torch.Tensor  # (rows,) int64: the tensor each row belongs to
    row_offset: torch.Tensor  # (rows,) int32: the index in its tensor of the row's first element
    draw: torch.Tensor  # (tensors,) int64: each tensor's draw number, counted from the step's first
    steps: torch.Tensor  # (tensors,) float32: Adam's step counts (equal within a group)


def row_scales(scale: torch.Tensor, layout: Layout, tensors: GroupTensors) -> torch.Tensor:
    """``scale`` as one value per buffer row, shaped (rows, 1) to broadcast."""
    return (scale if layout.per_row else scale[tensors.row_tensor])[:, None]


def stored_row_amax(data: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Each row's amax of the real values ``data`` (rows, width) stores under ``row_scale``
    (rows, 1), as (rows,): taken over the data, then divided by the row's scale, which
    scales a row's values alike (the amax of the decoded row, bit for bit)."""
    # FP16 and BF16 data: the amax in their own dtype (abs and max round nothing), so that
    # no float32 conversion follows the one that stored them. torch 2.11's Inductor folds
    # ``x.to(float16).float()`` into ``x`` even under emulate_precision_casts: the amax was
    # then the unrounded values', and a resumed run, which measures the stored ones, parted
    # from an uninterrupted one.
    stored = data if data.element_size() == 2 else data.float()
    return stored.abs().amax(dim=1, keepdim=True).float().div(row_scale).squeeze(1)


def per_tensor_max(row_values: torch.Tensor, tensors: GroupTensors) -> torch.Tensor:
    """The max over each tensor's rows of ``row_values`` (rows,), (tensors,) float32."""
    out = tensors.draw.new_zeros(tensors.draw.shape, dtype=torch.float32)
    return out.scatter_reduce(0, tensors.row_tensor, row_values.float(), "amax")


def grad_row_amax(grad: torch.Tensor, scale: torch.Tensor | None, layout: Layout, tensors: GroupTensors) -> torch.Tensor:
    """A bound on each buffer row's gradient amax, (rows,): the format's largest value over
    the row's scale (what a saturating cast can hold; NaN where the cast saw an inf or
    NaN), or the row's amax of a float gradient."""
    if scale is None:
        return grad.abs().amax(dim=1)
    return scaling.max_value(grad.dtype) / row_scales(scale, layout, tensors)[:, 0]


def grad_amax(grad: torch.Tensor, scale: torch.Tensor | None, layout: Layout, tensors: GroupTensors,
              row_amax: torch.Tensor | None) -> torch.Tensor:
    """The same bound over each tensor, (tensors,): from a per-tensor ``scale``, else the
    max over the tensor's rows of ``grad_row_amax``'s ``row_amax`` (given then)."""
    if scale is not None and not layout.per_row:
        return scaling.max_value(grad.dtype) / scale
    assert row_amax is not None, "a gradient scaled per row, or a float one, is bounded row by row"
    return per_tensor_max(row_amax, tensors)


def _store(
    values: torch.Tensor, layout: Layout, bound: torch.Tensor, previous: torch.Tensor | None, old: torch.Tensor,
    tensors: GroupTensors, words: torch.Tensor | None, skip: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(data, scales, each row's amax of what is stored)`` of float32 ``values``, the
    scales from ``bound`` (per tensor or per row, as the layout scales: no store waits on
    a reduction); where ``skip``, the stored data ``old`` and the ``previous`` scales, bit
    for bit. The amaxes are what the next step's bounds start from (zeros where nothing
    is scaled)."""
    if not layout.scaled:
        return unless_skipped(skip, old, values), None, tensors.row_tensor.new_zeros(tensors.row_tensor.shape,
                                                                                     dtype=torch.float32)
    scale = layout.scales(bound, previous)
    row_scale = row_scales(scale, layout, tensors)
    data = layout.encode_rows(values, row_scale, words)
    amax = stored_row_amax(data, row_scale)
    if previous is not None:
        scale = unless_skipped(skip, previous, scale)
    return unless_skipped(skip, old, data), scale, amax


def _write(pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
    """Copy each new tensor into its buffer (in the pass that computes it, compiled), the
    buffer as handed in (``in_sixteens``)."""
    for buffer, new in pairs:
        if buffer is not None and new is not None:
            buffer.copy_(new.view(buffer.shape) if new.dim() != buffer.dim() else new)


SIXTEEN = 16
"""Elements a buffer row holds a multiple of where ``in_sixteens`` splits it."""
_DATA_FIELDS = ("grad", "exp_avg", "exp_avg_sq", "weight", "fp8_weight")


def takes_sixteens(tensors: GroupTensors) -> bool:
    """Whether the compiled step takes ``tensors`` ``in_sixteens``: on devices whose
    kernels Inductor writes in Triton (not the CPU, whose C++ loops vectorize a row of any
    length, and ran the split rows slower), called from eager code (inside a graph being
    traced, the graph has the shapes already)."""
    return tensors.grad.device.type != "cpu" and not torch.compiler.is_compiling()


def in_sixteens(tensors: GroupTensors) -> GroupTensors:
    """``tensors`` with each (rows, width) data buffer viewed as (rows, width / 16, 16)
    where its width is a multiple of 16 (at least 32), for the compiled step: its rows'
    length is then a multiple of 16 by their shape, which a graph compiled for every
    width cannot otherwise know, and a GPU kernel loads and stores several neighbouring
    elements of a row with one instruction only where it knows that (the update of O2
    over rows of 1,024 elements: 180 -> 140 instructions an element on sm_90,
    ``bench/triton_code.py``)."""
    width = tensors.grad.shape[1]
    if width % SIXTEEN or width < 2 * SIXTEEN:
        return tensors
    views: dict[str, torch.Tensor] = {}
    for name in _DATA_FIELDS:
        if getattr(tensors, name) is not None:
            views[name] = getattr(tensors, name).view(-1, width // SIXTEEN, SIXTEEN)
            torch._dynamo.mark_static(views[name], 2)  # every other size stays dynamic
    return tensors._replace(**views)


def _as_rows(tensors: GroupTensors) -> GroupTensors:
    """``tensors`` with its data buffers (rows, width) again (``in_sixteens`` undone)."""
    if tensors.grad.dim() == 2:
        return tensors
    return tensors._replace(**{name: getattr(tensors, name).flatten(1)
                               for name in _DATA_FIELDS if getattr(tensors, name) is not None})


def adam_group_step(
    spec: UpdateSpec, tensors: GroupTensors, h: Hyper, s: StepScalars, seed_part: torch.Tensor | int,
    first_draw: torch.Tensor | int, skip: torch.Tensor,
) -> torch.Tensor:
    """One Adam / AdamW update of every tensor in ``tensors``, written into its buffers;
    returns the row amaxes (3, rows) of what it stored, for ``keep_amaxes``
    (nothing changes where ``skip``, a bool on the device, but the draws counted), with
    the coefficients ``s`` of step ``steps[0] + 1``.

    Tensor ``t`` rounds under the noise key ``noise.rounding_key(seed, first_draw + draw[t])``
    (from ``seed_part = noise.seed_key(seed)``), the key the reference step draws for it.
    The data buffers may come ``in_sixteens``.
    """
    buffers, tensors = tensors, _as_rows(tensors)
    grad = spec.grad.decode_rows(tensors.grad, None if tensors.grad_scale is None
                                 else row_scales(tensors.grad_scale, spec.grad, tensors))
    exp_avg = spec.exp_avg.decode_rows(tensors.exp_avg, None if tensors.exp_avg_scale is None
                                       else row_scales(tensors.exp_avg_scale, spec.exp_avg, tensors))
    exp_avg_sq = spec.exp_avg_sq.decode_rows(tensors.exp_avg_sq, None if tensors.exp_avg_sq_scale is None
                                             else row_scales(tensors.exp_avg_sq_scale, spec.exp_avg_sq, tensors))
    weight_layout = spec.weight_layout
    weight = weight_layout.decode_rows(tensors.weight, None if tensors.weight_scale is None
                                       else row_scales(tensors.weight_scale, weight_layout, tensors))
    exp_avg_amax, exp_avg_sq_amax, weight_amax = tensors.amaxes.unbind()
    if spec.weight is WeightKind.PLAIN and spec.decay is Decay.L2:  # read here: the model may write it
        weight_amax = per_tensor_max(weight.abs().amax(dim=1), tensors)
    rows_scaled = [layout.scaled and layout.per_row for layout in (spec.exp_avg, spec.exp_avg_sq)]
    grad_rows = None  # the gradient's row bounds, taken once where anything needs them
    if any(rows_scaled) or tensors.grad_scale is None or spec.grad.per_row:
        grad_rows = grad_row_amax(tensors.grad, tensors.grad_scale, spec.grad, tensors)
    bounds = amax_bounds(grad_amax(tensors.grad, tensors.grad_scale, spec.grad, tensors, grad_rows), exp_avg_amax,
                         exp_avg_sq_amax, weight_amax, h, s, spec.decay)
    exp_avg_bound, exp_avg_sq_bound = bounds.exp_avg, bounds.exp_avg_sq
    # O3's FP8 weight under row scales: each row's scale from a bound on its master row's
    # new amax, so that its cast, too, waits on no reduction over the row.
    fp8_rows = spec.weight is WeightKind.MASTER and spec.fp8_weight.per_row
    fp8_bound = weight_bound(tensors.row_amaxes[2], h, s, spec.decay) if fp8_rows else bounds.weight
    if any(rows_scaled):  # the moments' bounds row by row
        assert grad_rows is not None
        row_bounds = amax_bounds(grad_rows, tensors.row_amaxes[0], tensors.row_amaxes[1],
                                 weight_amax[tensors.row_tensor], h, s, spec.decay)
        exp_avg_bound = row_bounds.exp_avg if rows_scaled[0] else exp_avg_bound
        exp_avg_sq_bound = row_bounds.exp_avg_sq if rows_scaled[1] else exp_avg_sq_bound
    new = adam_arithmetic(
        grad, exp_avg, exp_avg_sq, weight, h, s, decay=spec.decay, maximize=spec.maximize, bounded=spec.bounded
    )
    exp_avg, exp_avg_sq, weight = new
    words = None
    if spec.stochastic:
        row_keys = noise.draw_key(seed_part, tensors.draw + first_draw)[tensors.row_tensor]
        width = tensors.grad.shape[1]
        columns = torch.arange(width, dtype=torch.int32, device=tensors.row_offset.device)
        if width & (width - 1) == 0:
            # A row starts at a multiple of its power-of-two width, so its elements' indices
            # are its offset's bits with a column's below them: ``(offset + column) ^ key``
            # is ``column ^ (offset ^ key)``, one operation per element fewer.
            words = noise.update_words(columns, (row_keys ^ tensors.row_offset.to(torch.int64))[:, None])
        else:
            words = noise.update_words(tensors.row_offset[:, None] + columns, row_keys[:, None])
    # A skipped step writes back the stored data it read (a select in the pass, not a second pass).
    m_data, m_scale, m_amax = _store(exp_avg, spec.exp_avg, exp_avg_bound, tensors.exp_avg_scale, tensors.exp_avg,
                                     tensors, words, skip)
    v_data, v_scale, v_amax = _store(exp_avg_sq, spec.exp_avg_sq, exp_avg_sq_bound, tensors.exp_avg_sq_scale,
                                     tensors.exp_avg_sq, tensors, None, skip)
    w_data, w_scale, w_amax = _store(weight, weight_layout, bounds.weight, tensors.weight_scale, tensors.weight,
                                     tensors, words, skip)
    fp8_data = fp8_scale = None
    if spec.weight is WeightKind.MASTER:  # O3's FP8 weight, from the master as stored
        previous = tensors.fp8_weight_scale if spec.fp8_previous_scale else None
        master = weight_layout.decode_rows(w_data, row_scales(w_scale, weight_layout, tensors))
        fp8_data, fp8_scale, _ = _store(master, spec.fp8_weight, fp8_bound, previous, tensors.fp8_weight,
                                        tensors, None, skip)
    _write([
        (buffers.exp_avg, m_data), (tensors.exp_avg_scale, m_scale), (buffers.exp_avg_sq, v_data),
        (tensors.exp_avg_sq_scale, v_scale), (buffers.weight, w_data), (tensors.weight_scale, w_scale),
        (buffers.fp8_weight, fp8_data), (tensors.fp8_weight_scale, fp8_scale),
    ])
    if any(rows_scaled) or fp8_rows:  # the weight's row amaxes only where a bound is taken from them
        new_rows = [m_amax, v_amax, w_amax] if fp8_rows else [m_amax, v_amax]
        kept = tensors.row_amaxes[:len(new_rows)]
        kept.copy_(unless_skipped(skip, kept, torch.stack(new_rows)))
    tensors.steps.add_((~skip).float())
    return torch.stack([m_amax, v_amax, w_amax])


@torch.no_grad()
def measure_amaxes(spec: UpdateSpec, tensors: GroupTensors) -> None:
    """Write into ``tensors``' amaxes and row amaxes the absolute maximum of each stored
    moment and weight, per tensor and per row, read off the buffers (zero where a storage
    has no scale to bound)."""
    for layout, data, scale, index in (
        (spec.exp_avg, tensors.exp_avg, tensors.exp_avg_scale, 0),
        (spec.exp_avg_sq, tensors.exp_avg_sq, tensors.exp_avg_sq_scale, 1),
        (spec.weight_layout, tensors.weight, tensors.weight_scale, 2),
    ):
        if not layout.scaled:
            tensors.amaxes[index].zero_()
            tensors.row_amaxes[index].zero_()
            continue
        rows = layout.decode_rows(data, row_scales(scale, layout, tensors)).abs().amax(dim=1)
        tensors.amaxes[index].copy_(per_tensor_max(rows, tensors))
        tensors.row_amaxes[index].copy_(rows)


def bounds_per_tensor(spec: UpdateSpec) -> bool:
    """Whether a step of ``spec`` bounds a scale per tensor (a moment or weight scaled
    per tensor), and so reads each tensor's amaxes; a group whose scales are all per row,
    or that has none, reads only row amaxes."""
    return any(layout.scaled and not layout.per_row for layout in (spec.exp_avg, spec.exp_avg_sq, spec.weight_layout))


def keep_amaxes(tensors: GroupTensors, row_amaxes: torch.Tensor, skip: torch.Tensor) -> None:
    """Keep each tensor's amaxes from ``adam_group_step``'s row amaxes (3, rows), unless
    ``skip``. Outside the compiled step: inductor runs a scatter as a call of its own,
    and one inside would split the pass that stores the data in two."""
    index = tensors.row_tensor.expand(row_amaxes.shape)
    new = tensors.amaxes.new_zeros(tensors.amaxes.shape).scatter_reduce_(1, index, row_amaxes.float(), "amax")
    tensors.amaxes.copy_(unless_skipped(skip, tensors.amaxes, new))


# emulate_precision_casts: Inductor otherwise folds ``x.to(float16).float()`` into ``x``
# inside a kernel, which would skip the rounding that stochastic rounding brackets.
# assert_indirect_indexing: the step indexes per-tensor values by ``row_tensor``, which the
# group builds in range; the bounds check Inductor adds would run per element.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "assert_indirect_indexing": False}


class GroupSteps:
    """``adam_group_step(spec, ...)`` compiled once per ``UpdateSpec`` (``torch.compile``,
    full graph, dynamic shapes), for one optimizer; ``compile=False`` runs it eagerly."""

    def __init__(self, compile: bool) -> None:
        self.compile = compile
        self._steps: dict[UpdateSpec, Callable[..., Any]] = {}

    def __call__(self, spec: UpdateSpec, tensors: GroupTensors, *args: Any) -> None:
        """``adam_group_step(spec, tensors, *args)``, compiled where asked, with the new
        amaxes written into ``tensors``."""
        step = self._steps.get(spec)
        if step is None:
            step = self._steps[spec] = self._build(spec)
        step(in_sixteens(tensors) if self.compile and takes_sixteens(tensors) else tensors, *args)

    def _build(self, spec: UpdateSpec) -> Callable[..., Any]:
        """The step of ``spec``: the update, and where it bounds a scale per tensor the
        tensors' amaxes kept after it (decided once per spec, not per step)."""
        def step(*args: Any) -> torch.Tensor:
            return adam_group_step(spec, *args)

        # Every spec of every optimizer keeps its own graphs and recompile limit.
        update = compile_privately(step, COMPILE_OPTIONS) if self.compile else step
        if not bounds_per_tensor(spec):
            return update

        def update_and_keep_amaxes(tensors: GroupTensors, *args: Any) -> None:
            keep_amaxes(tensors, update(tensors, *args), args[-1])

        return update_and_keep_amaxes

    @property
    def specs(self) -> tuple[UpdateSpec, ...]:
        """The update specs compiled so far."""
        return tuple(self._steps)
