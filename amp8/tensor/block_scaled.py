"""Microscaled formats (Blackwell): MXFP8 and NVFP4 quantize and dequantize.

MXFP8: E4M3 (or E5M2) elements, one E8M0 (power-of-two) scale per 32 consecutive
elements along a GEMM's contraction dimension. NVFP4: E2M1 elements packed two per byte
(``torch.float4_e2m1fn_x2``), one E4M3 scale per 16 elements, and one float32 scale for
the whole tensor. Both are held as a ``BlockScaledTensor``, whose scales are *decode*
scales as the hardware reads them: ``real = element * block_scale * tensor_scale``.

amp8's choices, where the formats leave room:

- E8M0 block scales are the power-of-two scales amp8 already takes (``scale_from_amax``
  with ``power_of_2=True``): the largest one that keeps the block's amax within the
  element format, so nothing saturates (OCP's rule floors the amax's exponent instead
  and clips up to a binade).
- NVFP4's tensor scale is a power of two: ``2**floor(log2(448 * 6 / amax))``. Decoding
  is then exact in float32 (an E2M1 value times an E4M3 scale times a power of two), and
  the block scales lose at most one of E4M3's seventeen binades at the bottom.
- FP4 rounds to nearest, ties to the even code, or stochastically under a noise key
  (``amp8.quant.noise``): up or down with the probability that makes the result unbiased.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from amp8.config.formats import E4M3, E8M0, FP4, is_fp4, max_value
from amp8.quant import noise, scaling

_FP4_SIGN = 0x8


# -- E2M1 codes ------------------------------------------------------------------------
def encode_fp4(values: torch.Tensor, noise_key: torch.Tensor | int | None = None) -> torch.Tensor:
    """The 4-bit E2M1 codes (uint8, sign in bit 3) of float ``values`` already scaled
    into ``[-6, 6]`` (larger magnitudes saturate, NaN takes the largest code). Rounds to
    nearest, ties to the even code, or stochastically under ``noise_key``."""
    fp4_max = max_value(FP4)
    magnitude = values.float().abs().clamp(max=fp4_max).nan_to_num(nan=fp4_max)
    # E2M1's grid is 0.5 apart below 2, 1 apart in [2, 4] and 2 apart in [4, 6]: in each
    # of these three ranges a code is the number of steps from the range's start plus
    # 2 per range below it, so the even step count is the even code.
    binade = (magnitude >= 2).to(torch.uint8) + (magnitude >= 4).to(torch.uint8)
    spacing = torch.exp2(binade.float() - 1)
    steps = magnitude / spacing  # exact: the spacing is a power of two
    if noise_key is None:
        steps = torch.round(steps)  # half to even
    else:
        low = torch.floor(steps)
        steps = low + (noise.uniform(magnitude.shape, noise_key, values.device) < steps - low).float()
    codes = steps.to(torch.uint8) + 2 * binade
    return codes + _FP4_SIGN * (values.float() < 0).to(torch.uint8)


def decode_fp4(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of E2M1 ``codes`` (uint8, sign in bit 3)."""
    # The magnitudes of codes 0-7, a literal for the reason in amp8.config.formats.max_value.
    grid = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), device=codes.device)
    magnitude = grid[(codes & 0x7).long()]
    return torch.where((codes & _FP4_SIGN) > 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack the 2-D uint8 ``codes`` two per byte along ``dim`` (the element with the even
    index in the low nibble), as uint8 bytes (``.view(torch.float4_e2m1fn_x2)`` gives the
    packed dtype); ``dim`` must have even size."""
    if codes.shape[dim] % 2:
        raise ValueError(f"FP4 packs pairs along dim {dim}; its size {codes.shape[dim]} is odd. Pad it to even")
    pairs = codes.movedim(dim, -1)
    return (pairs[..., 0::2] | (pairs[..., 1::2] << 4)).movedim(-1, dim).contiguous()


def unpack_fp4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The uint8 E2M1 codes of ``pack_fp4(codes, dim)`` (as bytes or viewed as the packed
    FP4 dtype), in ``codes``' shape."""
    raw = packed.view(torch.uint8).movedim(dim, -1)
    pairs = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)
    return pairs.movedim(-1, dim)


# -- block-scaled tensors --------------------------------------------------------------
@dataclass(frozen=True)
class BlockScaledTensor:
    """A 2-D tensor in a microscaled format.

    Attributes:
        data: the elements: FP8 of the logical shape, or FP4 packed two per byte along
            ``packed_dim`` (that dim then has half the logical size). Packed FP4 is held
            as its uint8 bytes (torch's CPU kernels cannot copy the packed dtype between
            layouts) and viewed as ``torch.float4_e2m1fn_x2`` where a GEMM takes it.
        scales: decode scales, one per ``tile`` (rows, columns): E8M0 (MX) or E4M3
            (NVFP4), of shape ``(ceil(R / rows), ceil(C / columns))``.
        tensor_scale: the float32 decode scale of the whole tensor (1 under MX).
        tile: the (rows, columns) tile that shares one block scale.
        packed_dim: the dim FP4 pairs are packed along, None for FP8 elements.
    """

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    tile: tuple[int, int]
    packed_dim: int | None = None

    @property
    def shape(self) -> torch.Size:
        """The logical (R, C) shape."""
        if self.packed_dim is None:
            return self.data.shape
        sizes = list(self.data.shape)
        sizes[self.packed_dim] *= 2
        return torch.Size(sizes)

    @property
    def dtype(self) -> torch.dtype:
        """The element dtype (FP8, or the packed FP4 dtype)."""
        return self.data.dtype if self.packed_dim is None else FP4

    @property
    def block_size(self) -> int:
        """Elements per block along the tile's longer edge."""
        return max(self.tile)

    @property
    def nbytes(self) -> int:
        """Bytes held: elements, block scales and the tensor scale."""
        return self.data.nbytes + self.scales.nbytes + self.tensor_scale.nbytes

    def element_values(self) -> torch.Tensor:
        """The elements as float32, unscaled, in the logical shape."""
        if self.packed_dim is None:
            return self.data.float()
        return decode_fp4(unpack_fp4(self.data, self.packed_dim))

    def decode_scales(self) -> torch.Tensor:
        """float32 ``block scale * tensor scale`` per tile (exact: both are powers of two
        times at most four significant bits)."""
        return self.scales.float() * self.tensor_scale

    def full_scales(self) -> torch.Tensor:
        """``decode_scales()`` repeated to the logical shape."""
        rows, cols = self.shape
        tile_rows, tile_cols = self.tile
        scales = self.decode_scales().repeat_interleave(tile_rows, 0)[:rows]
        return scales.repeat_interleave(tile_cols, 1)[:, :cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values, ``element * block scale * tensor scale``, in ``dtype``."""
        return (self.element_values() * self.full_scales()).to(dtype)

    def t(self) -> "BlockScaledTensor":
        """The transposed matrix (data and scales transposed, the tile swapped)."""
        packed = None if self.packed_dim is None else 1 - self.packed_dim
        return BlockScaledTensor(self.data.t(), self.scales.t(), self.tensor_scale, self.tile[::-1], packed)

    def with_data(self, data: torch.Tensor) -> "BlockScaledTensor":
        """The same values with ``data`` in another memory layout."""
        return dataclasses.replace(self, data=data)

    def packed_along(self, dim: int) -> "BlockScaledTensor":
        """The same values with FP4 pairs packed along ``dim`` (a lossless repack), so
        a GEMM contracting ``dim`` reads pairs of consecutive K-elements."""
        if self.packed_dim is None or self.packed_dim == dim:
            return self
        return dataclasses.replace(self, data=pack_fp4(unpack_fp4(self.data, self.packed_dim), dim), packed_dim=dim)


def _contract_dim(tile: tuple[int, int]) -> int:
    """The dim a 1-D tile runs along (1 for a square tile: FP4 packs along rows)."""
    return 0 if tile[0] > tile[1] else 1


def quantize_mx(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], *, margin: int = 0
) -> BlockScaledTensor:
    """MXFP8: the 2-D ``x`` as ``dtype`` (E4M3 or E5M2) with one E8M0 scale per ``tile``,
    the largest power of two that keeps the tile's amax within ``dtype`` (divided by
    ``2**margin``); an all-zero or non-finite tile gets scale 1."""
    storage = scaling.scale_from_amax(scaling.tile_amax(x, tile), dtype, margin=margin, power_of_2=True)
    data = scaling.quantize(x, scaling.expand_scale(storage, tuple(x.shape), max(tile)), dtype)
    scales = storage.reciprocal().to(E8M0)  # powers of two: exact
    return BlockScaledTensor(data, scales, torch.ones((), device=x.device), tile)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The float32 decode scale of an NVFP4 tensor with absolute maximum ``amax``: the
    power of two ``2**-floor(log2(448 * 6 / amax))`` (1 for a zero or non-finite amax)."""
    encode = scaling.scale_from_amax(amax / max_value(FP4), E4M3, power_of_2=True)  # floored 448 * 6 / amax
    return encode.reciprocal()


def quantize_nvfp4(
    x: torch.Tensor, tile: tuple[int, int], *, noise_key: torch.Tensor | int | None = None
) -> BlockScaledTensor:
    """NVFP4: the 2-D ``x`` as E2M1 elements packed along the tile's long edge (rows
    for a square tile), one E4M3 scale per ``tile`` and one power-of-two tensor scale.
    The block scale is the tile's ``amax / 6`` in tensor-scale units, rounded to E4M3
    (NaN for a tile holding inf or NaN, whose values then dequantize to NaN); elements
    round to nearest (even), or stochastically under ``noise_key``."""
    tensor_scale = nvfp4_tensor_scale(scaling.amax(x))
    block_amax = scaling.tile_amax(x, tile)
    # A block holding inf or NaN gets a NaN scale (E2M1 has none), so the overflow stays visible.
    block_scales = (block_amax / max_value(FP4) / tensor_scale).clamp(max=max_value(E4M3)).add_(block_amax * 0.0).to(E4M3)
    decode = scaling.expand_scale(block_scales.float() * tensor_scale, tuple(x.shape), max(tile))
    scaled = torch.where(decode > 0, x.float() / decode, 0.0)  # an all-zero tile (or an underflowed scale)
    dim = _contract_dim(tile)
    if x.shape[dim] % 2:
        raise ValueError(f"NVFP4 packs pairs along dim {dim}; got shape {tuple(x.shape)}. Pad that dim to even")
    data = pack_fp4(encode_fp4(scaled, noise_key), dim)
    return BlockScaledTensor(data, block_scales, tensor_scale, tile, dim)


def quantize_block_scaled(
    x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], *, margin: int = 0,
    noise_key: torch.Tensor | int | None = None,
) -> BlockScaledTensor:
    """``x`` (2-D) in the microscaled format of element ``dtype``: NVFP4 for the packed
    FP4 dtype (``quantize_nvfp4``), MXFP8 for an FP8 dtype (``quantize_mx``)."""
    if is_fp4(dtype):
        return quantize_nvfp4(x, tile, noise_key=noise_key)
    if noise_key is not None:
        raise ValueError("stochastic rounding is implemented for FP4 elements only; pass noise_key=None")
    return quantize_mx(x, dtype, tile, margin=margin)


def data_noise_key(x: torch.Tensor) -> torch.Tensor:
    """A stochastic-rounding key from the bits of ``x`` itself (an int64 scalar tensor in
    ``[0, 2**32)``): no counter to keep, the same key for the same tensor eagerly and
    compiled, and a new one whenever the gradient changes."""
    words = x.detach().float().contiguous().view(torch.int32).to(torch.int64)
    return noise.hash32(words.sum() & 0xFFFFFFFF)
