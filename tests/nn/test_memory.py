"""Bytes saved for backward, counted exactly on small known graphs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.nn.memory import count_saved_bytes, is_parameter_copy, persistent_storages

SHAPES = [(8, 32, 64), (16, 64, 128)]  # (tokens, in, hidden)


def _mlp(features: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, features))


@pytest.mark.parametrize("tokens, features, hidden", SHAPES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_gelu_linear_saves_input_and_both_activations(tokens: int, features: int, hidden: int, autocast: bool) -> None:
    """x (saved by the first Linear), its output (saved by GELU) and GELU's output (saved
    by the second Linear); the weights are parameters (FP32) or their autocast copies
    (BF16), counted apart."""
    model = _mlp(features, hidden)
    x = torch.randn(tokens, features, requires_grad=True)
    dtype = torch.bfloat16 if autocast else torch.float32
    size = torch.finfo(dtype).bits // 8
    mode = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with mode, count_saved_bytes(model) as saved:
        model(x).sum().backward()
    assert saved.bytes == size * tokens * (features + 2 * hidden), saved
    assert saved.by_dtype == {str(dtype).removeprefix("torch."): saved.bytes}
    weights = sum(layer.weight.numel() for layer in model if isinstance(layer, nn.Linear))
    assert saved.parameter_copy_bytes == (size * weights if autocast else 0)
    assert saved.persistent_skipped == (0 if autocast else 2)
    assert saved.per_token(tokens) == saved.bytes / tokens


def test_views_of_one_storage_count_once() -> None:
    x = torch.randn(4, 96, requires_grad=True)
    with count_saved_bytes() as saved:
        q, k, v = (x * 2).split(32, dim=1)  # three views of one (4, 96) storage
        (q * k * v).sum()
    assert saved.tensors == 4  # q, k; q * k, v
    assert saved.bytes == 4 * 96 * 4 + 4 * 32 * 4  # the split storage once, q * k


@pytest.mark.parametrize("features, tokens", [(32, 8), (64, 24)])
def test_tensorwise_fp8_linear_saves_its_fp8_input(features: int, tokens: int) -> None:
    layer = Fp8Linear.from_linear(nn.Linear(features, 2 * features), amp8.Recipe())
    x = torch.randn(tokens, features, requires_grad=True)
    with count_saved_bytes(layer) as saved:
        layer(x).sum().backward()
    # data, its scale and the scale's reciprocal (which the weight-gradient GEMM takes)
    assert saved.by_dtype == {"float8_e4m3fn": tokens * features, "float32": 8}


def test_parameter_copies_are_recognised() -> None:
    layer = nn.Linear(8, 8)
    parameters = persistent_storages(layer)
    assert is_parameter_copy(layer.weight.to(torch.bfloat16).t(), parameters)
    assert not is_parameter_copy(layer.weight * 2, parameters)
    leaf_input = torch.randn(8, 8, requires_grad=True)
    assert not is_parameter_copy(leaf_input.to(torch.bfloat16), parameters)


def test_per_token_refuses_a_bad_count() -> None:
    with count_saved_bytes() as saved:
        pass
    with pytest.raises(ValueError, match="tokens=0"):
        saved.per_token(0)


@pytest.mark.parametrize("model", ["model", 3, [nn.Linear(2, 2)]])
def test_count_saved_bytes_refuses_what_is_not_a_model(model: object) -> None:
    with pytest.raises(TypeError, match=rf"torch\.nn\.Module.*got {type(model).__name__}"):
        with count_saved_bytes(model):  # type: ignore[arg-type]
            pass
