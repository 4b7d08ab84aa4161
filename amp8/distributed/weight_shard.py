"""``Fp8WeightShard``: one rank's rows of an FP8 weight, as FSDP2 shards and gathers them.

FSDP2 asks a parameter's local tensor how to all-gather it (``fsdp_pre_all_gather``) and
how to rebuild the full tensor from what arrived (``fsdp_post_all_gather``): the public
extension point of ``fully_shard`` for tensor subclasses. This one hands FSDP2 the shard's
bytes as uint8, which every backend can move (gloo has no FP8 dtype), counts them in the
run's ``WireStats``, and views the gathered bytes as the FP8 weight again, without a copy.

It wraps a plain FP8 tensor and runs every operation on that. Operations that give a
tensor of the shard's FP8 dtype (the views, chunks and padded copies FSDP2 makes of it,
in-place writes) give a shard again; anything else (real values, byte views) a plain
tensor. A shard pickles as its plain FP8 tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from amp8.distributed.fp8_collectives import WireStats


class Fp8WeightShard(torch.Tensor):
    """FP8 weight rows that FSDP2 all-gathers as bytes, counting them in ``stats``.

    Wrap a weight's FP8 data (not copied) with ``Fp8WeightShard(data, stats)`` and hand
    it to ``fully_shard`` inside an ``nn.Parameter``: FSDP2 keeps each rank's rows of it.
    """

    _data: torch.Tensor
    stats: WireStats

    @staticmethod
    def __new__(cls, data: torch.Tensor, stats: WireStats) -> "Fp8WeightShard":
        """A tensor with ``data``'s shape, strides, dtype and device and no memory of its
        own (``__init__`` keeps ``data``)."""
        if data.element_size() != 1 or not data.is_floating_point() or type(data) is not torch.Tensor:
            raise TypeError(f"Fp8WeightShard wraps a plain FP8 tensor, got a {type(data).__name__} of {data.dtype}")
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, stats: WireStats) -> None:
        self._data = data
        self.stats = stats

    def plain(self) -> torch.Tensor:
        """The FP8 rows as a plain tensor that shares this shard's memory."""
        return self._data

    def __repr__(self) -> str:  # type: ignore[override]
        """The wrapped FP8 tensor's repr, named as a shard."""
        return f"Fp8WeightShard({self._data!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle as the plain FP8 tensor: ``torch.save`` and torch.distributed.checkpoint
        store FP8 data that loads anywhere (``weights_only=True`` included), without this
        class or its stats."""
        return self._data.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], WireStats]:
        """The inner tensor's name and the context that rebuilds the shard (torch.compile)."""
        return ["_data"], self.stats

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], stats: WireStats, outer_size: torch.Size, outer_stride: tuple[int, ...]
    ) -> "Fp8WeightShard":
        """The shard that ``__tensor_flatten__`` took apart."""
        return Fp8WeightShard(inner["_data"], stats)

    @classmethod
    def __torch_dispatch__(
        cls,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``func`` on the plain FP8 tensors; FP8 results of the shard's dtype come
        back as shards, an in-place operation returns the shard it changed."""
        source = next(_shards((args, kwargs)))
        plain_args, plain_kwargs = _map_tensors((tuple(args), dict(kwargs or {})), _unwrap)
        result = func(*plain_args, **plain_kwargs)
        if plain_args and result is plain_args[0]:
            return args[0]
        return _map_tensors(result, lambda t: cls(t, source.stats) if t.dtype == source.dtype else t)

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        """The bytes this rank sends, padded to the rows of the largest shard (what FSDP2
        expects where the rows do not split evenly); counts them as sent to every other
        rank."""
        rows = -(-outer_size[0] // mesh.size())
        data = self._data
        if data.shape[0] != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[: data.shape[0]] = data
            data = padded
        sent = data.view(torch.uint8)
        self.stats.add("all_gather", sent.nbytes * (mesh.size() - 1))
        return (sent,), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered bytes viewed as the FP8 weight (FSDP2 trims the padding rows),
        with the bytes as the buffer FSDP2 frees after use. FSDP2 gathers into the same
        buffer every time, so the weight built by the first call (``out`` later) already
        holds the new bytes."""
        (gathered,) = all_gather_outputs
        if out is None:
            return gathered.view(self.dtype), (gathered,)
        if out.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
            raise RuntimeError(
                "FSDP2 gathered an FP8 weight into a new buffer; Fp8WeightShard expects the "
                "weight from its first all-gather to view every later one"
            )
        return None


def _unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a shard, or ``tensor`` itself."""
    return tensor.plain() if isinstance(tensor, Fp8WeightShard) else tensor


def _shards(tree: Any) -> Iterator[Fp8WeightShard]:
    """The shards inside nested arguments (lists, tuples, dicts)."""
    if isinstance(tree, Fp8WeightShard):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _shards(item)
    elif isinstance(tree, Mapping):
        for item in tree.values():
            yield from _shards(item)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` (a tensor, or lists, tuples and dicts of them) with ``fn`` applied to
    every tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)([_map_tensors(item, fn) for item in tree])  # type: ignore[call-arg]
    if isinstance(tree, dict):
        return {key: _map_tensors(item, fn) for key, item in tree.items()}
    return tree
