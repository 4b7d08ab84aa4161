import pytest
import torch
import torch.distributed as dist

from amp8.distributed.fp8_collectives import WireStats, fp8_all_reduce_mean, fp8_reduce_scatter_mean
from amp8.distributed.layout import ShardLayout
from amp8.quant.scaling import sqnr
import multiprocess


@pytest.mark.parametrize("numels", [(10,), (7, 64, 1), (1000, 3)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_pack_unpack_round_trip(numels: tuple[int, ...], world: int) -> None:
    layout = ShardLayout(numels, world)
    flats = [torch.randn(n) for n in numels]
    packed = layout.pack(flats)
    assert packed.shape == (world, layout.columns)
    for flat, back in zip(flats, layout.unpack(packed)):
        assert torch.equal(flat, back)
    for index, flat in enumerate(flats):
        pieces = [flat[slice(*layout.shard_range(index, rank))] for rank in range(world)]
        assert torch.equal(torch.cat(pieces), flat)
        row0 = layout.segments(packed[0])[index]
        start, end = layout.shard_range(index, 0)
        assert torch.equal(row0[: end - start], flat[start:end])


@pytest.mark.parametrize("rows", [(5, 7), (1, 3), (3, 16), (9, 1)])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_row_layout_gives_each_rank_the_rows_fully_shard_gives_it(rows: tuple[int, int], world: int) -> None:
    """Whole rows per rank, as ``torch.chunk`` along dim 0 (FSDP2's sharding) cuts them,
    empty chunks included when there are fewer rows than ranks."""
    weight = torch.randn(rows)
    layout = ShardLayout((weight.numel(), 5), world, (rows[1], 1))
    chunks = list(torch.chunk(weight, world, dim=0))
    chunks += [weight[:0]] * (world - len(chunks))
    for rank, chunk in enumerate(chunks):
        start, end = layout.shard_range(0, rank)
        assert torch.equal(weight.flatten()[start:end], chunk.flatten())
    packed = layout.pack([weight.flatten(), torch.randn(5)])
    assert torch.equal(layout.unpack(packed)[0], weight.flatten())


def _reduce(rank: int, world: int) -> dict:
    generator = torch.Generator().manual_seed(rank)
    # Rank-dependent magnitudes: rank 1's values are 1000x larger.
    flats = [torch.randn(n, generator=generator) * (1000.0 ** rank) for n in (4096, 1000, 17)]
    stats = WireStats()
    reduced = fp8_all_reduce_mean(flats, stats=stats)
    exact = [flat.clone() for flat in flats]
    for flat in exact:
        dist.all_reduce(flat)
        flat /= world
    layout, shard = fp8_reduce_scatter_mean(flats)
    nonfinite = [torch.randn(64) if rank == 0 else torch.full((64,), float("inf"))]
    return {
        "reduced": reduced, "exact": exact, "bytes": stats.bytes_by_kind, "shard": shard,
        "nonfinite": fp8_all_reduce_mean(nonfinite), "columns": layout.columns,
    }


@pytest.mark.multiprocess
def test_fp8_all_reduce_against_fp32_on_two_processes(tmp_path) -> None:
    results = multiprocess.run(_reduce, tmp_path)
    for rank_result in results:
        for reduced, exact in zip(rank_result["reduced"], rank_result["exact"]):
            measured = sqnr(exact, reduced)
            assert measured >= 25.0, f"FP8 all-reduce SQNR {measured:.1f} dB"
        assert all(not torch.isfinite(x).any() for x in rank_result["nonfinite"]), "inf must reach every rank"
    for a, b in zip(results[0]["reduced"], results[1]["reduced"]):
        assert torch.equal(a, b), "ranks must agree bit for bit"
    # One byte per element plus the scales: all-to-all and all-gather each move half.
    numel = 4096 + 1000 + 17
    columns = results[0]["columns"]
    expected = {"all_to_all": (2 * columns + 2 * 3 * 4) // 2, "all_gather": columns + 3 * 4}
    assert results[0]["bytes"] == expected
    assert sum(expected.values()) <= 1.01 * numel
