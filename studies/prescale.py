"""Does FP8-LM's automatic pre-scaling help an FP8 gradient all-reduce? amp8's per-piece
scales against FP8-LM's shared scale, with and without the pre-scaling factor.

    python studies/prescale.py                              # 2-32 simulated ranks, 2**17 values, 8 steps
    python studies/prescale.py --ranks 4 64 --numel 1048576 --steps 40 --seed 1
    python studies/prescale.py --growth-interval 4          # let the factor grow back within a run

N ranks are simulated in one process: row ``r`` of an ``(N, numel)`` float32 tensor is
rank ``r``'s gradient, and collectives are done by indexing. Each step draws fresh
gradients from a regime: ``gaussian`` (a common std), ``student-t3`` (heavy-tailed,
Student-t with 3 degrees of freedom) or ``loud-rank`` (Gaussian, one rank drawn at random
each step 100x larger). Every scheme's mean over ranks is compared with the exact mean
(float64 over the float32 gradients):

- ``amp8``: amp8's all-reduce (amp8/distributed/fp8_collectives.py, its own functions): every
  (chunk, tensor) piece cast to E4M3 with its own scale, all-to-all, float32 sum in rank
  order, divide by N, requantize with fresh per-piece scales, all-gather.
- ``amp8 + mu``: the same, on ``mu * g`` with the factor undone after; ``mu`` is the
  automatic factor of ``shared + mu`` at the same step.
- ``shared``: FP8-LM's shared-scale FP8 sum without pre-scaling: one scale per tensor for
  all ranks, ``448 / amax`` over all ranks (the min of the ranks' scales), each rank's
  gradient cast with it, then a ring reduce: each hop adds the next rank's FP8 values to
  the partial sum and casts the partial sum back to E4M3 with the same scale (clipping
  at 448); the mean divides by N in float32 after.
- ``shared / N``: the same with FP8-LM's plain pre-scaling, ``g / N`` before the cast.
- ``shared + mu``: the same with FP8-LM's automatic scaling, ``mu * g`` before the cast
  (the paper's ``g' = mu g``; the division by ``N mu`` comes after the sum, in float32),
  ``mu`` adapted between steps by ``next_factor``.

The shared scale is taken from the amax of the unscaled gradients: a scale taken from
``mu * g``'s own amax would cancel ``mu`` exactly, so ``mu`` can only buy headroom for the
sum as a factor on top of the amax scale. Metrics per scheme and step, on the mean's
values: the SQNR, ``10 log10(sum ref^2 / sum (ref - x)^2)``; the fraction that saturated
(a cast on their way clipped a value, see ``clip_limit``; this fraction of ``shared +
mu`` drives ``mu``); the fraction where a cast flushed a nonzero input to zero; the
fraction that came out zero while the exact mean is not (flushing, or rounded values that
cancel exactly). The table gives the median SQNR over steps and the worst step, which
catches the steps before ``mu`` has adapted. Results go to ``--out`` (studies/results/):
prescale-cpu.json, with every step's numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from amp8.config.formats import max_value
from amp8.distributed.fp8_collectives import WIRE_DTYPE, _dequantize_pieces, _quantize_pieces
from amp8.distributed.layout import ShardLayout
from amp8.monitor.console import default_console
from amp8.quant import scaling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/records.py writes the results
from records import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

REGIMES = ("gaussian", "student-t3", "loud-rank")
SCHEMES = ("amp8", "amp8 + mu", "shared", "shared / N", "shared + mu")
GRADIENT_STD = 1e-3
LOUD_FACTOR = 100.0
DEFAULT_RANKS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ScalingPolicy:
    """FP8-LM's automatic scaling of the pre-scaling factor ``mu``.

    After a step whose saturated fraction exceeds ``threshold`` (0.001 %, the paper's),
    ``mu`` is multiplied by ``backoff`` (1/2, the paper's) and the clean-step count
    restarts; after ``growth_interval`` consecutive clean steps ``mu`` is multiplied by
    ``growth`` (the paper raises it "exponentially to 2 over 1,000 steps": x2 after 1000
    clean steps here) and the count restarts. ``mu`` stays within ``[min_factor,
    max_factor]``: above 1 the largest gradients would clip in their own cast, before any
    sum. Every value is a power of two, so applying and undoing ``mu`` is exact.
    """

    threshold: float = 1e-5
    backoff: float = 0.5
    growth: float = 2.0
    growth_interval: int = 1000
    max_factor: float = 1.0
    min_factor: float = 2.0**-24
    initial: float = 1.0


def next_factor(factor: float, clean_steps: int, saturated_fraction: float,
                policy: ScalingPolicy = ScalingPolicy()) -> tuple[float, int]:
    """``(mu, clean steps)`` for the next step, from this step's ``mu``, the clean steps
    before it and the fraction of values that saturated in it."""
    if saturated_fraction > policy.threshold:
        return max(factor * policy.backoff, policy.min_factor), 0
    clean_steps += 1
    if clean_steps >= policy.growth_interval:
        return min(factor * policy.growth, policy.max_factor), 0
    return factor, clean_steps


def clip_limit(dtype: torch.dtype) -> float:
    """The largest magnitude, in scaled units, that rounds to ``dtype``'s max anyway (464
    for E4M3, 61440 for E5M2): only beyond it does clipping change a value. Counting
    values above the max itself would count amax elements whose float32 scale rounded up
    by one ulp (``x * (448 / x)`` can be 448.00003)."""
    info = torch.finfo(dtype)
    top_step = 2.0 ** (math.floor(math.log2(info.max)) + round(math.log2(info.eps)))
    return max_value(dtype) + top_step / 2


@dataclass
class Reduced:
    """A simulated all-reduce's mean over ranks and, per element, whether a cast on its
    way clipped a value (``saturated``) or flushed a nonzero value to zero (``flushed``)."""

    mean: torch.Tensor
    saturated: torch.Tensor
    flushed: torch.Tensor


def gradients(regime: str, ranks: int, numel: int, generator: torch.Generator) -> torch.Tensor:
    """One step's float32 gradients, one row per rank, drawn from ``regime``."""
    normal = torch.randn(ranks, numel, generator=generator)
    if regime == "gaussian":
        return normal * GRADIENT_STD
    if regime == "student-t3":
        # chi-squared with 3 degrees of freedom: -2 log U has 2, a squared normal 1
        uniform = torch.rand(ranks, numel, generator=generator)
        chi2 = -2 * torch.log1p(-uniform) + torch.randn(ranks, numel, generator=generator).pow(2)
        return normal / (chi2 / 3).sqrt() * GRADIENT_STD
    if regime == "loud-rank":
        loud = int(torch.randint(ranks, (1,), generator=generator))
        normal[loud] *= LOUD_FACTOR
        return normal * GRADIENT_STD
    raise ValueError(f"unknown regime {regime!r}; expected one of {REGIMES}")


def _cast_flags(packed: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Which values of ``packed`` clipped, and which nonzero ones became zero, when
    ``_quantize_pieces`` cast them to ``data`` with ``scales``."""
    limit = clip_limit(WIRE_DTYPE)
    clipped = [(piece.float() * scales[..., index, None]).abs() > limit
               for index, piece in enumerate(layout.segments(packed))]
    flushed = (packed != 0) & (data.float() == 0)
    return torch.cat(clipped, dim=-1), flushed


def amp8_mean(grads: torch.Tensor, factor: float = 1.0) -> Reduced:
    """amp8's FP8 all-reduce mean of ``factor * grads`` over ranks (rows), undone by
    ``factor``, computed as ``fp8_all_reduce_mean`` computes it on every rank."""
    ranks, numel = grads.shape
    layout = ShardLayout((numel,), ranks)
    packed = torch.stack([layout.pack([grads[rank] * factor]) for rank in range(ranks)])
    sent = [_quantize_pieces(rows, layout) for rows in packed]
    sent_flags = [_cast_flags(rows, data, scales, layout) for rows, (data, scales) in zip(packed, sent)]
    owned_rows = []
    for owner in range(ranks):  # the all-to-all: the owner gets its chunk from every rank
        data = torch.stack([data[owner] for data, _ in sent])
        scales = torch.stack([scales[owner] for _, scales in sent])
        owned_rows.append(_dequantize_pieces(data, scales, layout).sum(dim=0) / layout.world)
    rows = torch.stack(owned_rows)
    gathered = [_quantize_pieces(row[None], layout) for row in owned_rows]
    data, scales = torch.cat([data for data, _ in gathered]), torch.cat([scales for _, scales in gathered])
    clipped, flushed = _cast_flags(rows, data, scales, layout)
    for sent_clipped, sent_flushed in sent_flags:
        clipped, flushed = clipped | sent_clipped, flushed | sent_flushed
    mean = _dequantize_pieces(data, scales, layout)
    return Reduced(layout.unpack(mean)[0] / factor, layout.unpack(clipped)[0], layout.unpack(flushed)[0])


def shared_ring_mean(grads: torch.Tensor, factor: float = 1.0, dtype: torch.dtype = WIRE_DTYPE) -> Reduced:
    """FP8-LM's mean over ranks (rows): ``factor * grads`` cast with one scale from the
    amax over all ranks of ``grads``, summed over a ring in FP8 (each hop's partial sum
    cast back with that scale), divided by ``factor * N`` in float32."""
    ranks, numel = grads.shape
    chunk = -(-numel // ranks)
    scale = scaling.scale_from_amax(scaling.amax(grads), dtype)
    padded = torch.nn.functional.pad(grads * factor, (0, ranks * chunk - numel)).view(ranks, ranks, chunk)
    limit = clip_limit(dtype)
    sent = scaling.quantize(padded, scale, dtype).float()
    clipped = (padded * scale).abs() > limit
    flushed = (padded != 0) & (sent == 0)
    chunks = torch.arange(ranks)
    # Chunk c starts at rank c + 1 and goes round the ring to its owner, rank c.
    order = (chunks[None, :] + torch.arange(1, ranks + 1)[:, None]) % ranks
    hops, saturated, flushed = sent[order, chunks], clipped[order, chunks].any(0), flushed[order, chunks].any(0)
    unit = torch.ones((), dtype=torch.float32)
    partial = hops[0]
    for values in hops[1:]:
        total = partial + values  # exact in float32: two FP8 values
        saturated |= total.abs() > limit
        partial = scaling.quantize(total, unit, dtype).float()
    mean = partial.flatten()[:numel] / (scale * factor) / ranks
    return Reduced(mean, saturated.flatten()[:numel], flushed.flatten()[:numel])


@dataclass
class StepMetrics:
    """One scheme's numbers at one step: SQNR of the mean in dB, and the fractions of the
    mean's values that saturated, that had a nonzero input flushed to zero by a cast, and
    that came out zero where the exact mean is not (flushing, or rounded values that
    cancel exactly)."""

    sqnr_db: float
    saturated: float
    flushed: float
    zeroed: float


def measure(reference: torch.Tensor, reduced: Reduced) -> StepMetrics:
    """``reduced``'s numbers against the exact mean ``reference``."""
    zeroed = (reduced.mean == 0) & (reference != 0)
    return StepMetrics(scaling.sqnr(reference, reduced.mean), _fraction(reduced.saturated),
                       _fraction(reduced.flushed), _fraction(zeroed))


def _fraction(mask: torch.Tensor) -> float:
    return float(mask.double().mean())


@dataclass
class Tally:
    """One scheme's numbers over the steps of a case."""

    steps: list[StepMetrics] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Median and worst SQNR over steps, the fractions averaged over steps, and every
        step's numbers."""
        per_step = {name: [getattr(step, name) for step in self.steps] for name in StepMetrics.__annotations__}
        return {
            "sqnr_db_median": statistics.median(per_step["sqnr_db"]),
            "sqnr_db_worst": min(per_step["sqnr_db"]),
            **{f"{name}_fraction": statistics.fmean(per_step[name]) for name in ("saturated", "flushed", "zeroed")},
            "per_step": per_step,
        }


def _bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def reduce_step(grads: torch.Tensor, factor: float) -> dict[str, Reduced]:
    """Every scheme's all-reduce of one step's ``grads``, ``factor`` being this step's mu."""
    ranks = grads.shape[0]
    shared = {1.0: shared_ring_mean(grads)}
    for extra in (1.0 / ranks, factor):  # the same factor gives the same result
        if extra not in shared:
            shared[extra] = shared_ring_mean(grads, extra)
    return {"amp8": amp8_mean(grads), "amp8 + mu": amp8_mean(grads, factor), "shared": shared[1.0],
            "shared / N": shared[1.0 / ranks], "shared + mu": shared[factor]}


def run_case(regime: str, ranks: int, numel: int, steps: int, seed: int,
             policy: ScalingPolicy = ScalingPolicy()) -> dict[str, Any]:
    """Every scheme over ``steps`` steps of ``regime`` gradients on ``ranks`` ranks; mu
    starts at ``policy.initial`` and follows ``next_factor`` on ``shared + mu``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 1_000 * REGIMES.index(regime) + ranks)
    tallies = {scheme: Tally() for scheme in SCHEMES}
    factor, clean_steps, factors, identical = policy.initial, 0, [], True
    for _ in range(steps):
        grads = gradients(regime, ranks, numel, generator)
        reference = grads.double().mean(dim=0)
        reduced = reduce_step(grads, factor)
        identical = identical and _bit_identical(reduced["amp8"].mean, reduced["amp8 + mu"].mean)
        for scheme, result in reduced.items():
            tallies[scheme].steps.append(measure(reference, result))
        factors.append(factor)
        factor, clean_steps = next_factor(factor, clean_steps, tallies["shared + mu"].steps[-1].saturated, policy)
    return {"regime": regime, "ranks": ranks, "mu_per_step": factors, "mu_next": factor,
            "amp8_prescaled_bit_identical": identical,
            "schemes": {scheme: tally.summary() for scheme, tally in tallies.items()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS), help="simulated world sizes")
    parser.add_argument("--numel", type=int, default=2**17, help="gradient values per rank")
    parser.add_argument("--steps", type=int, default=8, help="steps per case (fresh gradients each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--growth-interval", type=int, default=ScalingPolicy.growth_interval,
                        help="clean steps before mu doubles")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON")
    return parser.parse_args(argv)


def _percent(fraction: float) -> str:
    return "0" if fraction == 0 else f"{100 * fraction:.2g}"


def _power(factor: float) -> str:
    exponent = math.log2(factor)
    return f"2^{exponent:.0f}" if exponent == round(exponent) else f"{factor:.3g}"


def _table(title: str, extra: str | None = None) -> Table:
    table = Table(title=title)
    table.add_column("regime")
    table.add_column("N", justify="right")
    for scheme in SCHEMES:
        table.add_column(scheme, justify="right")
    if extra:
        table.add_column(extra, justify="right")
    return table


def print_tables(cases: list[dict[str, Any]], numel: int, steps: int) -> None:
    """The SQNR of every scheme with mu's first and last value, then the saturated,
    flushed and zeroed percentages."""
    sqnr_table = _table(f"SQNR of the mean (dB): median over {steps} steps (worst step), "
                        f"{numel:,} values per rank, E4M3", "mu first .. last")
    fraction_table = _table("% of the mean's values over all steps: saturated / flushed by a cast / "
                            "zero where the exact mean is not")
    for case in cases:
        schemes, mus = case["schemes"].values(), case["mu_per_step"]
        sqnr_table.add_row(case["regime"], str(case["ranks"]),
                           *(f"{s['sqnr_db_median']:.1f} ({s['sqnr_db_worst']:.1f})" for s in schemes),
                           f"{_power(mus[0])} .. {_power(mus[-1])}")
        fraction_table.add_row(case["regime"], str(case["ranks"]), *(
            " / ".join(_percent(s[f"{name}_fraction"]) for name in ("saturated", "flushed", "zeroed"))
            for s in schemes))
    console = default_console()
    console.print(sqnr_table)
    console.print(fraction_table)


def main(argv: list[str] | None = None) -> Path:
    """Run the study; returns the path of the JSON written."""
    args = parse_args(argv)
    policy = ScalingPolicy(growth_interval=args.growth_interval)
    cases = [run_case(regime, ranks, args.numel, args.steps, args.seed, policy)
             for regime in args.regimes for ranks in args.ranks]
    print_tables(cases, args.numel, args.steps)
    identical = all(case["amp8_prescaled_bit_identical"] for case in cases)
    print(f"amp8 + mu bit-identical to amp8 in every case: {identical}")
    payload = {
        "numel": args.numel, "steps": args.steps, "seed": args.seed, "wire_dtype": str(WIRE_DTYPE),
        "gradient_std": GRADIENT_STD, "loud_factor": LOUD_FACTOR,
        "clip_limit": clip_limit(WIRE_DTYPE),
        "policy": {**asdict(policy), "description": (
            "mu starts at 1 and multiplies each rank's gradient before the FP8 cast (the shared scale comes "
            "from the unscaled amax; the sum is divided by N mu after, in float32); after a step where more "
            "than 0.001 % of the mean's values saturated, mu halves and the clean count restarts; after "
            "growth_interval consecutive clean steps mu doubles, capped at 1")},
        "reference": "float64 mean of the float32 gradients",
        "cases": cases,
    }
    path = write_result("prescale", torch.device("cpu"), payload, args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
