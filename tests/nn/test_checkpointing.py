"""Activation checkpointing (``torch.utils.checkpoint``, transformers'
``gradient_checkpointing_enable``) runs a block's forward again in backward: amp8's FP8
layers repeat the first forward's casts there (the same scales, so the same FP8 data) and
record nothing, so a checkpointed model trains as the same model without checkpoints, bit
for bit, under every scaling (delayed scaling's history included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp8
from amp8 import _compat
from moe_models import tiny_moe_model
from zoo_models import ZOO

RECIPES = {
    "tensorwise": amp8.Recipe(),
    "rowwise": amp8.Recipe.preset("rowwise"),
    "delayed": amp8.Recipe(scaling="delayed", amax_history_len=4),
}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class _Blocks(nn.Module):
    """Two residual MLP blocks, each run through ``checkpoint`` unless ``how`` is None."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.how is None else checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


def _train(model: nn.Module, level: str, recipe: amp8.Recipe, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` AdamW steps of ``model`` under amp8 (every layer FP8), two micro-batches
    each: the outputs, input gradients and, at the end, the state dict."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp8.initialize(model, optimizer, level, recipe=recipe, layer_selection="all")
    seen = []
    for step in range(steps):
        for micro_batch in range(2):
            torch.manual_seed(10 * step + micro_batch)
            x = torch.randn(16, 32, requires_grad=True)
            y = model(x)
            y.square().mean().backward()
            seen += [y.detach(), x.grad]
        optimizer.step()
        optimizer.zero_grad()
    return seen + [value for value in model.state_dict().values() if isinstance(value, torch.Tensor)]


def _assert_bitwise(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual):
        if want.dtype.itemsize == 1:  # FP8: byte for byte
            want, got = want.view(torch.uint8), got.view(torch.uint8)
        assert torch.equal(want, got)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_checkpointed_blocks_train_as_without_checkpoints(level: str, recipe: str, how: str) -> None:
    torch.manual_seed(0)
    expected = _train(_Blocks(None), level, RECIPES[recipe])
    torch.manual_seed(0)
    actual = _train(_Blocks(how), level, RECIPES[recipe])
    _assert_bitwise(expected, actual)


def test_a_recomputed_forward_records_nothing() -> None:
    """The forward that checkpointing runs again leaves the layers' scales and amax
    histories as the first forward left them (delayed scaling would otherwise push each
    amax twice)."""
    torch.manual_seed(0)
    model, _ = amp8.initialize(_Blocks("non-reentrant"), None, "O1", recipe=RECIPES["delayed"], layer_selection="all")
    y = model(torch.randn(16, 32, requires_grad=True))
    before = {name: buffer.clone() for name, buffer in model.named_buffers() if "scale" in name or "history" in name}
    y.square().mean().backward()
    after = dict(model.named_buffers())
    for name, value in before.items():
        # The backward records its own casts: the output gradients' row only.
        rows = slice(0, 2) if value.dim() else slice(None)
        assert torch.equal(after[name][rows], value[rows]), name


def test_running_backward_is_seen_only_in_backward() -> None:
    seen = []

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            seen.append(_compat.running_backward())
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            seen.append(_compat.running_backward())
            return grad

    _Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True]


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_checkpointed_experts_train_as_without_checkpoints(level: str) -> None:
    def run(checkpointed: bool) -> list[torch.Tensor]:
        model, _ = amp8.initialize(tiny_moe_model(num_experts=4), None, level, layer_selection="all")
        seen = []
        for step in range(2):
            torch.manual_seed(100 + step)
            x = torch.randn(24, 32, requires_grad=True)
            y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
            y.square().mean().backward()
            seen += [y.detach(), x.grad] + [p.grad.dequantize() if hasattr(p.grad, "dequantize") else p.grad
                                             for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        return seen

    _assert_bitwise(run(False), run(True))


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_transformers_gradient_checkpointing_trains_as_without(recipe: str) -> None:
    """A transformers model with ``gradient_checkpointing_enable()`` (as Trainer's
    ``gradient_checkpointing=True`` sets it) at O2: the same losses, gradients and
    weights as without, bit for bit."""
    pytest.importorskip("transformers")
    zoo = ZOO["llama"]

    def run(checkpointed: bool) -> list[torch.Tensor]:
        model = zoo.build()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = amp8.initialize(model, optimizer, "O2", recipe=RECIPES[recipe], layer_selection="all")
        seen = []
        for step in range(2):
            loss = model(**zoo.make_batch(seed=step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.detach())
        return seen + [value for value in model.state_dict().values() if isinstance(value, torch.Tensor)]

    _assert_bitwise(run(False), run(True))


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_fp8_activations_change_nothing_inside_checkpointed_blocks(how: str) -> None:
    """A checkpointed block keeps none of its activations until backward recomputes them,
    outside the FP8 activation storage's hooks (docs/memory.md)."""
    torch.manual_seed(0)
    high = _train(_Blocks(how), "O1", amp8.Recipe())
    torch.manual_seed(0)
    fp8 = _train(_Blocks(how), "O1", amp8.Recipe(activations="fp8"))
    _assert_bitwise(high, fp8)
