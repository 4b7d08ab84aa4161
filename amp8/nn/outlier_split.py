"""The outlier tokens of a weight-gradient GEMM, taken out to run in float32
(``Recipe.wgrad_outlier_split``).

Scales along the token dim (which wgrad contracts) serve every token row of a block
alike: one row far above the others pushes them binades down, toward FP8's flush to
zero. ``split_outlier_tokens`` takes such rows out of the FP8 GEMM and returns their
contribution in float32, so the FP8 GEMM of the rest plus that contribution is the whole
product.
"""

from __future__ import annotations

from fractions import Fraction

import torch

OUTLIER_ROW_RATIO = 2**8
"""A token row is an outlier where its amax exceeds the median row amax of its operand
(over the rows that are not all zero) more than this many times. A row ``2**r`` above
the others pushes them ``r`` binades down a scale along tokens: E4M3 flushes 1 % of a
GELU output's values from about ``r = 10`` on (the controller's threshold), so the
split takes such rows with four times to spare, while rows of healthy activations and
gradients stay within a few binades of the median. An int: ``torch.compile(dynamic=True)``
reads a global int as a constant, where it makes a float a graph input."""


def token_share(share: float) -> tuple[int, int]:
    """``share`` (of a recipe's ``wgrad_outlier_share``) as the ratio of ints
    ``(numerator, denominator)`` that ``split_outlier_tokens`` counts tokens with: the
    fraction nearest it with a denominator up to a million (0.07 is 7/100). In integers
    the window ``ceil(share * M)`` is exact, where a float product rounds up across an
    integer for some M (``0.07 * 100`` is 7.000000000000001), and it traces with symbolic
    sizes (``torch.compile(dynamic=True)``), which a float read in traced code does not."""
    ratio = Fraction(share).limit_denominator(1_000_000)
    return ratio.numerator, ratio.denominator


def split_outlier_tokens(
    x2: torch.Tensor, g2: torch.Tensor, share: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take the outlier tokens out of a weight-gradient GEMM ``g2^T @ x2`` (x2: (M, K),
    g2: (M, N)): the rows whose amax in either operand exceeds that operand's median
    row amax more than ``OUTLIER_ROW_RATIO`` times, at most ``ceil(share * M)`` of them
    (the largest; ``share`` as ``token_share`` gives it). Returns their float32
    contribution ``(N, K)`` and both operands with their rows zeroed, so the FP8 GEMM of
    the rest, plus the contribution, is the whole product; with no outlier row the
    operands are returned unchanged and the contribution is zero.

    The float32 product runs over the ``ceil(share * M)`` candidate rows with the
    largest ratio, those that are not outliers zeroed: the shapes depend on M alone,
    so compiled graphs keep static shapes, and the count of rows taken out follows the
    batch."""
    numerator, denominator = share
    window = min(x2.shape[0], -(-x2.shape[0] * numerator // denominator))
    score = torch.fmax(_relative_row_amax(x2), _relative_row_amax(g2))
    rows = score.topk(window, sorted=False).indices.sort().values  # in token order, as the GEMM sums
    taken = score.index_select(0, rows) > OUTLIER_ROW_RATIO  # (window,)
    g_taken = torch.where(taken[:, None], g2.index_select(0, rows).float(), 0.0)
    x_taken = torch.where(taken[:, None], x2.index_select(0, rows).float(), 0.0)
    outliers = g_taken.t() @ x_taken
    drop = torch.zeros(x2.shape[0], dtype=torch.bool, device=x2.device).index_copy(0, rows, taken)[:, None]
    return outliers, x2.masked_fill(drop, 0), g2.masked_fill(drop, 0)


def _relative_row_amax(x2: torch.Tensor) -> torch.Tensor:
    """Each row's amax over the median amax of the rows that are not all zero (float32;
    NaN where every row is zero, which no comparison takes)."""
    amax = x2.abs().amax(1).float()
    median = torch.where(amax > 0, amax, torch.nan).nanmedian()
    return amax / median
