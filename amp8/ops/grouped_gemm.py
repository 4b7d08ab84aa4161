"""Grouped FP8 GEMMs: one GEMM per expert over tokens sorted by expert.

A mixture-of-experts layer multiplies each expert's tokens by that expert's weights. The
tokens are sorted by expert into one matrix whose rows come in groups, one per expert
(``ExpertGroups``), each padded with zero rows to a multiple of ``GEMM_ALIGNMENT``: the
weight-gradient GEMM contracts over an expert's tokens, and an FP8 GEMM's K must be a
multiple of 16 (CUDA's grouped kernel also needs each group to start 16 bytes into the
row). Every operand is given per expert, as the casts made it: a ``ScaledTensor`` (one
scale per tensor, per row or per block) or a microscaled ``BlockScaledTensor``, or None
for an expert without tokens, whose GEMM is skipped.

- ``grouped_fp8_gemm`` (forward and input-gradient GEMMs): expert e's rows times its
  (K, N) matrix, written to its rows of one (rows, N) output.
- ``grouped_fp8_wgrad`` (weight-gradient GEMM): expert e's (N, rows_e) @ (rows_e, K),
  one (N, K) matrix per expert; zeros for an expert without tokens.

On a GPU that has torch's grouped FP8 kernel (``amp8._compat.native_grouped_scaled_mm``:
sm_90 and sm_100) and operands it takes (E4M3 both, one scale per tensor or per row),
each is one ``torch._scaled_grouped_mm`` call, whose arguments (``grouped_kernel_arguments``)
pass ``check_grouped_operands`` first; it writes bfloat16, converted to the asked dtype.
Elsewhere (the CPU, E5M2 gradients, block scales, microscaled formats) each expert is one
``amp8.ops.gemm.fp8_gemm`` call, which checks the dense CUDA operand contract per expert:
on the CPU the result is bit for bit that of the experts' dense FP8 GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import torch

from amp8 import _compat
from amp8.config.formats import E4M3
from amp8.config.gemms import Gemm
from amp8.ops.gemm import fp8_gemm
from amp8.quant.scale_layout import GEMM_ALIGNMENT
from amp8.tensor.block_scaled import BlockScaledTensor
from amp8.tensor.scaled import ScaledTensor

Operand = ScaledTensor | BlockScaledTensor
"""One expert's FP8 matrix with its scales, as a cast gives it."""

_GROUPED_OUT_DTYPE = torch.bfloat16  # the only output torch's grouped FP8 kernel writes


@dataclass(frozen=True)
class ExpertGroups:
    """Where each expert's tokens sit in a token matrix sorted by expert.

    Attributes:
        counts: the number of tokens routed to each expert, in expert order.

    Each expert's group of rows is padded with zero rows to a multiple of
    ``GEMM_ALIGNMENT`` (an expert without tokens has no rows).
    """

    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in self.counts):
            raise ValueError(f"ExpertGroups.counts={self.counts!r} is not valid; use one int >= 0 per expert")

    @classmethod
    def from_counts(cls, counts: torch.Tensor | Sequence[int]) -> "ExpertGroups":
        """Groups for ``counts`` tokens per expert (a tensor is read once, on the host)."""
        values = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        return cls(tuple(int(value) for value in values))

    @property
    def num_experts(self) -> int:
        """The number of experts, E."""
        return len(self.counts)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each expert's rows: its token count rounded up to a multiple of ``GEMM_ALIGNMENT``."""
        return tuple(-(-count // GEMM_ALIGNMENT) * GEMM_ALIGNMENT for count in self.counts)

    @property
    def starts(self) -> tuple[int, ...]:
        """The first row of each expert's group."""
        return tuple(accumulate(self.sizes[:-1], initial=0))

    @property
    def rows(self) -> int:
        """All rows of the padded token matrix."""
        return sum(self.sizes)

    @property
    def active(self) -> tuple[int, ...]:
        """The experts that have tokens, whose GEMMs run."""
        return tuple(expert for expert, count in enumerate(self.counts) if count)

    def group(self, expert: int) -> slice:
        """The rows of ``expert``'s group."""
        start = self.starts[expert]
        return slice(start, start + self.sizes[expert])

    def offsets(self, device: torch.device) -> torch.Tensor:
        """The end row of each group, int32 (the ``offs`` of torch's grouped GEMMs)."""
        return torch.tensor(self.sizes, device=device).cumsum(0).to(torch.int32)


def _check_parts(a: Sequence[Operand | None], b: Sequence[Operand | None], groups: ExpertGroups) -> None:
    """Raise ``ValueError`` unless ``a`` and ``b`` hold one operand per expert, present
    exactly for the experts with tokens."""
    if len(a) != groups.num_experts or len(b) != groups.num_experts:
        raise ValueError(
            f"a grouped GEMM over {groups.num_experts} experts needs one operand per expert, got "
            f"{len(a)} and {len(b)}"
        )
    active = set(groups.active)
    for name, parts in (("a", a), ("b", b)):
        given = {expert for expert, part in enumerate(parts) if part is not None}
        if given != active:
            raise ValueError(
                f"grouped GEMM operand {name} has operands for experts {sorted(given)}, but the experts "
                f"with tokens are {sorted(active)}; cast exactly those (None for the others)"
            )


def grouped_fp8_gemm(
    a: Sequence[Operand | None],
    b: Sequence[Operand | None],
    groups: ExpertGroups,
    out_features: int,
    out_dtype: torch.dtype,
    role: Gemm,
) -> torch.Tensor:
    """Each expert's token rows times its matrix: ``out[groups.group(e)] = a[e] @ b[e]``.

    Args:
        a: per expert, its (``groups.sizes[e]``, K) rows, row-major (None: no tokens).
        b: per expert, its (K, N) matrix, column-major (None: no tokens).
        groups: the experts' token groups.
        out_features: N (the output's width, also when no expert has tokens).
        out_dtype: float32, bfloat16 or float16.
        role: FPROP or DGRAD (fast accumulation for FPROP only).

    Returns:
        The (``groups.rows``, N) output; an expert's padding rows hold its product with
        zero rows (zeros).

    Raises:
        ValueError: operands missing for an expert with tokens (or given for one without),
            or operands that break the GEMM contract.
    """
    _check_parts(a, b, groups)
    device = _device(a, b)
    if _grouped_kernel_takes(a, b, device):
        args = grouped_kernel_arguments(a, b, groups, contraction=False)
        return _run_grouped_kernel(*args, role=role).to(out_dtype)
    return expert_rows(
        groups, out_features, out_dtype, device,
        lambda expert: fp8_gemm(a[expert], b[expert], out_dtype, role),  # type: ignore[arg-type]
    )


def grouped_fp8_wgrad(
    a: Sequence[Operand | None],
    b: Sequence[Operand | None],
    groups: ExpertGroups,
    shape: tuple[int, int],
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Each expert's weight gradient, contracting over its tokens: ``out[e] = a[e] @ b[e]``.

    Args:
        a: per expert, its (N, ``groups.sizes[e]``) output-gradient columns, row-major.
        b: per expert, its (``groups.sizes[e]``, K) input rows, column-major.
        groups: the experts' token groups (padding rows are zeros in both operands).
        shape: (N, K), each expert's gradient.
        out_dtype: the dtype of the result.

    Returns:
        (E, N, K): each expert's gradient, zeros for an expert without tokens.

    Raises:
        ValueError: as ``grouped_fp8_gemm``.
    """
    _check_parts(a, b, groups)
    device = _device(a, b)
    if _grouped_kernel_takes(a, b, device):
        args = grouped_kernel_arguments(a, b, groups, contraction=True)
        return _run_grouped_kernel(*args, role=Gemm.WGRAD).to(out_dtype)
    return expert_matrices(
        groups, shape, out_dtype, device,
        lambda expert: fp8_gemm(a[expert], b[expert], out_dtype, Gemm.WGRAD),  # type: ignore[arg-type]
    )


def expert_rows(
    groups: ExpertGroups, width: int, dtype: torch.dtype, device: torch.device, product: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """The (``groups.rows``, width) matrix whose rows of expert e are ``product(e)``, for
    the experts with tokens only; zeros elsewhere."""
    out = torch.zeros(groups.rows, width, dtype=dtype, device=device)
    for expert in groups.active:
        out[groups.group(expert)] = product(expert)
    return out


def expert_matrices(
    groups: ExpertGroups, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
    product: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """The (E, *shape) stack whose matrix e is ``product(e)``, for the experts with tokens
    only; zeros elsewhere."""
    out = torch.zeros(groups.num_experts, *shape, dtype=dtype, device=device)
    for expert in groups.active:
        out[expert] = product(expert)
    return out


def _device(a: Sequence[Operand | None], b: Sequence[Operand | None]) -> torch.device:
    """The device of the operands (the CPU where no expert has tokens)."""
    present = next((part for part in (*a, *b) if part is not None), None)
    return torch.device("cpu") if present is None else present.data.device


def _grouped_kernel_takes(a: Sequence[Operand | None], b: Sequence[Operand | None], device: torch.device) -> bool:
    """Whether torch's grouped FP8 kernel runs these operands on ``device``."""
    return _compat.native_grouped_scaled_mm(device) and grouped_kernel_takes(a, b)


def grouped_kernel_takes(a: Sequence[Operand | None], b: Sequence[Operand | None]) -> bool:
    """Whether torch's grouped FP8 kernel takes these operands (on a GPU that has it):
    E4M3 both, with one scale per tensor or per row (not per block, not microscaled)."""
    parts = [part for part in (*a, *b) if part is not None]
    return bool(parts) and all(
        isinstance(part, ScaledTensor) and part.dtype == E4M3 and part.block_size == 0 and part.scale.dim() in (0, 2)
        for part in parts
    )


def _decode_scales(part: Operand | None, length: int, device: torch.device) -> torch.Tensor:
    """The (length,) float32 decode scales of one expert's operand along its rows (``a``)
    or columns (``b``): its one scale repeated, or its per-row (per-column) scales; ones
    for an expert without tokens."""
    if part is None:
        return torch.ones(length, device=device)
    scale = part.scale.float().reciprocal()  # type: ignore[union-attr]
    return scale.expand(length) if scale.dim() == 0 else scale.reshape(-1).expand(length)


def grouped_kernel_arguments(
    a: Sequence[Operand | None], b: Sequence[Operand | None], groups: ExpertGroups, *, contraction: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b, offs)`` of the ``torch._scaled_grouped_mm`` call
    for the per-expert operands of ``grouped_fp8_gemm`` (``contraction=False``: mat_a
    (rows, K) row-major, mat_b (E, K, N) column-major, scale_a (rows,), scale_b (E, N))
    or of ``grouped_fp8_wgrad`` (``contraction=True``: mat_a (N, rows) row-major, mat_b
    (rows, K) column-major, scale_a (E * N,), scale_b (E * K,)). Scales are decode scales
    (one per tensor repeated along its rows or columns); an expert without tokens takes
    zero weights (E4M3 zero bytes) and unit scales.

    Raises:
        ValueError: the arguments break the kernel's contract (``check_grouped_operands``).
    """
    present = [(expert, part) for expert, part in enumerate(a) if part is not None]
    device = present[0][1].data.device
    first_a, first_b = present[0][1], b[present[0][0]]
    offs = groups.offsets(device)
    if contraction:
        n, k = first_a.shape[0], first_b.shape[1]  # type: ignore[union-attr]
        mat_a = torch.cat([a[e].data for e in groups.active], 1)  # type: ignore[union-attr]
        mat_b = torch.cat([b[e].data.t() for e in groups.active], 1).t()  # type: ignore[union-attr]
        scale_a = torch.cat([_decode_scales(a[e], n, device) for e in range(groups.num_experts)])
        scale_b = torch.cat([_decode_scales(b[e], k, device) for e in range(groups.num_experts)])
    else:
        k, n = first_b.shape  # type: ignore[union-attr]
        zero = torch.zeros(n, k, dtype=E4M3, device=device)
        mat_a = torch.cat([a[e].data for e in groups.active])  # type: ignore[union-attr]
        mat_b = torch.stack([zero if part is None else part.data.t() for part in b]).transpose(1, 2)
        scale_a = torch.cat([_decode_scales(a[e], groups.sizes[e], device) for e in groups.active])
        scale_b = torch.stack([_decode_scales(part, n, device) for part in b])
    check_grouped_operands(mat_a, mat_b, scale_a, scale_b, offs)
    return mat_a, mat_b, scale_a, scale_b, offs


def check_grouped_operands(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor
) -> None:
    """Raise ``ValueError`` if the arguments break the contract of CUDA's
    ``torch._scaled_grouped_mm`` with rowwise scales, on any device.

    torch's own checks run on ``meta`` copies of the arguments (its meta kernel repeats
    the CUDA kernel's: E4M3 operands, mat_a row-major and mat_b column-major with 16-byte
    strides, 1-D or per-group float32 scales of the right lengths, int32 offsets, a
    bfloat16 output); amp8 adds what depends on values: every group's rows a multiple of
    ``GEMM_ALIGNMENT``, and K and N multiples of it.
    """
    k_and_n = (mat_a.shape[-1], mat_b.shape[-1])
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    if any(dim % GEMM_ALIGNMENT for dim in k_and_n) or bool((sizes % GEMM_ALIGNMENT).any()):
        raise ValueError(
            f"grouped FP8 GEMM needs K, N and every group's rows to be multiples of {GEMM_ALIGNMENT}; got "
            f"(K or rows, N) = {k_and_n} and groups of {sizes.tolist()} rows: pad each group with zero rows"
        )
    meta = [
        torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        for t in (mat_a, mat_b, scale_a, scale_b, offs)
    ]
    try:
        torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=_GROUPED_OUT_DTYPE)
    except RuntimeError as error:  # torch._check raises RuntimeError
        raise ValueError(f"grouped FP8 GEMM arguments break torch._scaled_grouped_mm's contract: {error}") from None


def _run_grouped_kernel(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
    *, role: Gemm,
) -> torch.Tensor:
    """One ``torch._scaled_grouped_mm`` call (bfloat16 out; fast accumulation for FPROP)."""
    return torch._scaled_grouped_mm(
        mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=_GROUPED_OUT_DTYPE, use_fast_accum=role is Gemm.FPROP
    )
