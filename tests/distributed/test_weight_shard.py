"""``Fp8WeightShard``: FSDP2's all-gather extension for O3's FP8 weights."""

import ast
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import amp8
import multiprocess
from amp8.distributed.fp8_collectives import WireStats
from amp8.distributed.weight_shard import Fp8WeightShard

E4M3 = torch.float8_e4m3fn
AMP8_SOURCES = Path(amp8.__file__).resolve().parent


def _fp8(rows: int, columns: int) -> torch.Tensor:
    return (torch.randn(rows, columns) * 10).to(E4M3)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def test_layout_operations_keep_the_shard_and_its_stats() -> None:
    """What FSDP2 does to a shard (detach, chunk, pad, narrow, flatten) gives shards that
    count in the same ``WireStats`` and show the same bytes."""
    stats = WireStats()
    data = _fp8(5, 4)
    shard = Fp8WeightShard(data, stats)
    padded = shard.new_zeros((3, 4))
    padded.narrow(0, 0, 1).copy_(torch.chunk(shard, 3, dim=0)[2])  # the last of 2, 2, 1 rows
    results = {
        "detach": shard.detach(), "chunk": torch.chunk(shard, 2, dim=0)[1], "view": shard.view(-1),
        "narrow": shard.narrow(0, 1, 2), "padded": padded, "parameter": nn.Parameter(shard),
    }
    for name, result in results.items():
        assert type(result) is Fp8WeightShard, name
        assert result.stats is stats, name
        assert result.dtype == E4M3, name
    assert torch.equal(_bytes(results["chunk"].plain()), _bytes(data[3:]))
    assert torch.equal(_bytes(padded.plain()), torch.cat([_bytes(data[4:]), torch.zeros(2, 4, dtype=torch.uint8)]))


def test_other_results_are_plain_tensors() -> None:
    """Real values and byte views leave the subclass: amp8's arithmetic sees plain tensors."""
    data = _fp8(4, 4)
    shard = Fp8WeightShard(data, WireStats())
    for name, result in {"float": shard.float(), "bytes": shard.view(torch.uint8), "equal": shard.plain() == data}.items():
        assert type(result) is torch.Tensor, name
    torch.testing.assert_close(shard.float(), data.float(), atol=0, rtol=0)


def test_in_place_writes_reach_the_wrapped_data() -> None:
    data = _fp8(4, 4)
    shard = Fp8WeightShard(data.clone(), WireStats())
    new = _fp8(4, 4)
    assert shard.copy_(new) is shard
    assert torch.equal(_bytes(shard.plain()), _bytes(new))


def test_a_shard_saves_as_its_plain_fp8_tensor() -> None:
    """``torch.save`` (and with it torch.distributed.checkpoint) stores the FP8 bytes,
    which load back under ``weights_only=True`` as a plain FP8 tensor."""
    data = _fp8(3, 8)
    buffer = io.BytesIO()
    torch.save({"weight": Fp8WeightShard(data, WireStats())}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["weight"]
    assert type(loaded) is torch.Tensor and loaded.dtype == E4M3
    assert torch.equal(_bytes(loaded), _bytes(data))


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_only_fp8_data_is_wrapped(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="plain FP8 tensor"):
        Fp8WeightShard(torch.zeros(2, 2, dtype=dtype), WireStats())


def _gather(rank: int, world: int, rows: int, columns: int) -> dict:
    """Each rank's ``torch.chunk`` rows of one FP8 weight, gathered the way FSDP2 does it:
    pre-all-gather, an all-gather of the bytes, post-all-gather (twice: the second time
    into the weight the first built)."""
    torch.manual_seed(0)
    weight = _fp8(rows, columns)
    stats = WireStats()
    shard = Fp8WeightShard(torch.chunk(weight, world, dim=0)[rank].clone(), stats)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    args = (mesh, weight.shape, weight.stride(), nn.Linear(1, 1), MixedPrecisionPolicy())
    (sent,), metadata = shard.fsdp_pre_all_gather(*args)
    gathered = torch.empty((world * sent.shape[0], *sent.shape[1:]), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, sent)
    full, freed = shard.fsdp_post_all_gather((gathered,), metadata, E4M3)
    first = full.clone()
    shard.fsdp_pre_all_gather(*args)
    again = shard.fsdp_post_all_gather((gathered,), metadata, E4M3, out=full)
    try:
        shard.fsdp_post_all_gather((gathered.clone(),), metadata, E4M3, out=full)
        new_buffer_error = ""
    except RuntimeError as error:
        new_buffer_error = str(error)
    return {
        "weight": weight, "full": first, "sent_dtype": sent.dtype, "sent_shape": tuple(sent.shape),
        "freed_is_gathered": freed[0] is gathered, "again": again, "bytes": stats.bytes_by_kind,
        "new_buffer_error": new_buffer_error,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("rows", [6, 5])  # 5 rows: rank 1 holds 2 of 3, padded for the wire
def test_pre_and_post_all_gather_give_back_the_whole_weight(tmp_path, rows: int) -> None:
    columns, world = 16, 2
    results = multiprocess.run(_gather, tmp_path, rows, columns)
    padded_rows = -(-rows // world)
    for result in results:
        assert result["sent_dtype"] == torch.uint8 and result["sent_shape"] == (padded_rows, columns)
        full = result["full"]
        assert full.dtype == E4M3
        assert torch.equal(_bytes(full[:rows]), _bytes(result["weight"])), "the gathered weight is the whole weight"
        assert result["freed_is_gathered"] and result["again"] is None
        # Two all-gathers, each sending this rank's padded rows to the other rank.
        assert result["bytes"] == {"all_gather": 2 * padded_rows * columns * (world - 1)}
        assert "new buffer" in result["new_buffer_error"]


def _private_torch_distributed_imports(source: str) -> list[str]:
    """``torch.distributed`` modules or names with a leading underscore that ``source``
    imports (FSDP2's internals among them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            modules = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[:2] == ["torch", "distributed"] and any(part.startswith("_") for part in parts[2:]):
                found.append(module)
    return found


def test_the_scan_finds_private_imports() -> None:
    source = (
        "import torch.distributed\nfrom torch.distributed.fsdp._fully_shard._fsdp_api import AllGather\n"
        "from torch.distributed.fsdp import fully_shard, _fully_shard\nimport torch.distributed._tensor\n"
    )
    assert _private_torch_distributed_imports(source) == [
        "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather", "torch.distributed.fsdp._fully_shard",
        "torch.distributed._tensor",
    ]


def test_amp8_imports_nothing_private_from_torch_distributed() -> None:
    """FSDP2 and the collectives are used through their public API only."""
    sources = sorted(AMP8_SOURCES.rglob("*.py"))
    assert sources, AMP8_SOURCES
    private = {str(path.relative_to(AMP8_SOURCES)): _private_torch_distributed_imports(path.read_text()) for path in sources}
    assert {path: names for path, names in private.items() if names} == {}
