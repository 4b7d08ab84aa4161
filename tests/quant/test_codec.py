"""The storage codec's layouts: a saved weight's layout read off its scales decodes it
as the layout that encoded it did."""

from __future__ import annotations

import pytest
import torch

from amp8._compiled import compile_privately
from amp8.quant.codec import Layout, Tiling
from conftest import assert_bitwise_equal

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("shape", [(64, 48), (50, 33), (8, 200)])
@pytest.mark.parametrize("tile", [None, "row", (1, 32), (32, 32), (16, 16)])
@pytest.mark.parametrize("dtype", [E4M3, torch.float16])
def test_a_saved_layout_read_off_its_scales_decodes_as_encoded(
    shape: tuple[int, int], tile: tuple[int, int] | str | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    values = torch.randn(shape) * torch.logspace(-3, 3, shape[1])
    tile = (1, shape[1]) if tile == "row" else tile
    layout = Layout.for_tile(dtype, tile, shape)  # type: ignore[arg-type]
    data, scale = layout.encode(values)
    assert scale is not None
    block = 0 if tile is None else max(tile)  # what a recipe records: its block size
    saved = Layout.of_saved(data, scale, block)
    assert saved.tiling == layout.tiling
    assert_bitwise_equal(saved.decode(data, scale), layout.decode(data, scale))


@pytest.mark.parametrize("shape", [(4, 32, 64), (4, 64, 32), (3, 50, 33), (2, 8, 200)])
@pytest.mark.parametrize("tile", [(32, 32), (1, 32), (16, 64)])
@pytest.mark.parametrize("dtype", [E4M3, torch.float16])
def test_a_stack_of_matrices_encodes_each_as_a_matrix_of_its_own(
    shape: tuple[int, int, int], tile: tuple[int, int], dtype: torch.dtype
) -> None:
    # A tile is of the last two dimensions: a stack of experts' weights whose rows fit in
    # one tile and whose columns do not (scales (E, 1, C)) once broadcast by the wrong ones.
    torch.manual_seed(0)
    values = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
    data, scale = Layout.for_tile(dtype, tile, shape).encode(values)
    matrix = Layout.for_tile(dtype, tile, shape[1:])
    for index, one in enumerate(values):
        one_data, one_scale = matrix.encode(one)
        assert_bitwise_equal(data[index], one_data)
        assert_bitwise_equal(scale[index], one_scale)
        assert_bitwise_equal(Layout.for_tile(dtype, tile, shape).decode(data, scale)[index],
                             matrix.decode(one_data, one_scale))


@pytest.mark.compile
@pytest.mark.parametrize("dtype, shape, tile", [
    (E4M3, (4, 32, 16), (1, 16)), (torch.float16, (4, 32, 16), (32, 16)),
    (torch.float16, (4, 32, 40), (16, 16)), (E4M3, (2, 24, 64), (32, 32)),
])
def test_compiled_encode_then_decode_of_a_stack_is_the_eager_one_bit_for_bit(
    shape: tuple[int, int, int], tile: tuple[int, int], dtype: torch.dtype
) -> None:
    # Scales computed in the graph, one tile spanning a dimension: their count there must
    # be a 1 the compiler knows (as a formula equal to 1, Inductor read the reciprocal's
    # broadcast at the column's index). Compiled as amp8 compiles its own functions.
    layout = Layout.for_tile(dtype, tile, shape, power_of_2=True)

    def roundtrip(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        data, scale = layout.encode(values)
        assert scale is not None
        return layout.decode(data, scale), data, scale

    torch.manual_seed(0)
    values = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
    compiled = compile_privately(roundtrip, {"emulate_precision_casts": True})
    for got, expected in zip(compiled(values), roundtrip(values)):
        assert_bitwise_equal(got, expected)


def test_row_scales_read_as_rows_and_a_scalar_as_one_scale() -> None:
    data = torch.zeros(4, 8, dtype=E4M3)
    assert Layout.of_saved(data, torch.ones(4, 1), 32).tiling is Tiling.ROWS
    assert Layout.of_saved(data, torch.ones(()), 32) == Layout(E4M3)


def test_scales_that_do_not_fit_the_data_are_an_error() -> None:
    data = torch.zeros(4, 8, dtype=E4M3)
    with pytest.raises(ValueError, match="do not fit"):
        Layout.of_saved(data, torch.ones(4), 32)
    with pytest.raises(ValueError, match="do not tile"):
        Layout.of_saved(data, torch.ones(3, 1), 32).decode(data, torch.ones(3, 1))


@pytest.mark.parametrize("tiling", ["tensor", "rows", "blocks"])
@pytest.mark.parametrize("dtype", [E4M3, torch.float8_e5m2, torch.float16, torch.bfloat16])
def test_power_of_two_scales_decode_by_their_reciprocal_as_by_a_division(dtype: torch.dtype, tiling: str) -> None:
    """A layout of power-of-two scales decodes by multiplying with each scale's reciprocal
    (one division a scale, not one an element): the quotient, bit for bit, over scales from
    2**-100 to the largest amp8 takes (2**126, where data / scale falls below float32's
    smallest normal)."""
    torch.manual_seed(0)
    rows, width = 64, 32
    exponents = torch.linspace(-100, 126, rows).round()
    values = torch.randn(rows, width) * torch.exp2(-exponents)[:, None]
    if tiling == "tensor":
        layouts = [Layout(dtype, power_of_2=True) for _ in range(rows)]
        pieces = [layout.encode(row) for layout, row in zip(layouts, values)]  # a scale per tensor, per row here
        data = torch.stack([piece[0] for piece in pieces])
        scale = torch.stack([piece[1] for piece in pieces])[:, None]
        layout = layouts[0]
        decoded = torch.stack([layout.decode(d, s[0]) for d, s in zip(data, scale)])
    else:
        layout = Layout(dtype, Tiling.ROWS, power_of_2=True) if tiling == "rows" else \
            Layout(dtype, Tiling.BLOCKS, block=width, power_of_2=True)
        data, scale = layout.encode(values)
        scale = scale.view(rows, 1)
        decoded = layout.decode(data, scale if tiling == "rows" else scale.view(-1))
    assert scale is not None and bool((torch.frexp(scale)[0] == 0.5).all()), "scales are powers of two"
    assert (data.float() / scale).abs().min() < torch.finfo(torch.float32).tiny  # subnormal quotients are in it
    assert_bitwise_equal(decoded, data.float() / scale)
    assert_bitwise_equal(layout.decode_rows(data, scale), data.float() / scale)
