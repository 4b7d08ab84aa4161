"""docs/migrating.md: every amp8 block on the page runs, and trains, as the page says.

The blocks are read from the page, not copied: a ```python block that follows a
``<!-- amp8: LEVEL [high=NAME,...] -->`` line is amp8's side of a mapping, run on a small
model with a torch AdamW; ``<!-- amp8: loop -->`` marks the training step run after each.
Every other ```python block is another library's code, shown for comparison and never run
(those libraries are not installed here).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

import amp8
from amp8.nn import Fp8Linear
from amp8.optim import LowBitAdam

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
MARKER = re.compile(r"^<!--\s*amp8:\s*(?P<args>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^```python\s*$")
LIBRARIES = ("# MS-AMP", "# apex", "# torchao", "# Transformer Engine")
OTHER_IMPORTS = re.compile(r"^\s*(from|import)\s+(msamp|apex|torchao|transformer_engine)\b", re.M)
FP8_LEVELS = ("O1", "O2", "O3")
KEEPS_OPTIMIZER = ("O0", "O1-compute")


@dataclass
class Block:
    section: str
    code: str
    level: str | None = None  # None: another library's block
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        first = next(line for line in self.code.splitlines() if line.strip())
        return f"{self.section}:{self.level}:{first.strip()[:48].rstrip()}"


def _blocks() -> list[Block]:
    """Every ```python block of the page, with its section and its marker's arguments."""
    lines = PAGE.read_text().splitlines()
    blocks, section, marker, i = [], "intro", None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        found = MARKER.match(line)
        if found:
            marker = found["args"].split()
        elif FENCE.match(line):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            level, options = None, {}
            if marker is not None:
                level = marker[0]
                options = dict(arg.split("=", 1) for arg in marker[1:])
            blocks.append(Block(section, "\n".join(lines[i + 1 : end]) + "\n", level, options))
            marker, i = None, end
        elif line.strip():
            marker = None  # a marker applies to the block right after it only
        i += 1
    return blocks


BLOCKS = _blocks()
LOOP = [block for block in BLOCKS if block.level == "loop"]
AMP8 = [block for block in BLOCKS if block.level not in (None, "loop")]


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=generator), torch.randn(8, 32, generator=generator)


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside a trainer's wrapper (Accelerate's ``AcceleratedOptimizer``)."""
    while not isinstance(optimizer, (LowBitAdam, torch.optim.AdamW)) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _run(code: str, namespace: dict) -> None:
    try:
        exec(compile(code, str(PAGE), "exec"), namespace)
    except ModuleNotFoundError as missing:  # an optional trainer (accelerate) not installed
        if missing.name and missing.name.split(".")[0] in ("accelerate",):
            pytest.skip(f"{missing.name} is not installed")
        raise


def _train_and_check(namespace: dict, level: str, high: set[str], given: torch.optim.Optimizer, what: str) -> None:
    """The model and optimizer in ``namespace`` are what ``level`` makes (the layers named in
    ``high`` kept in high precision), and one step of the page's loop trains every parameter
    with a finite loss."""
    model, optimizer = namespace["model"], _unwrapped(namespace["optimizer"])
    fp8 = {name for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    expected = set() if level == "O0" else {"0", "2"} - high
    assert fp8 == expected, f"{what}: FP8 layers {sorted(fp8)}, expected {sorted(expected)}"
    if level in FP8_LEVELS:
        assert isinstance(optimizer, LowBitAdam), f"{what}: {type(optimizer).__name__}, expected LowBitAdam"
        assert optimizer.level.name == level, f"{what}: LowBitAdam at {optimizer.level.name}, expected {level}"
    else:
        assert optimizer is given, f"{what}: {level} should return the optimizer it was given"
    skipped = getattr(optimizer, "skipped_steps", 0)
    with torch.no_grad():
        before = [p.float().clone() for p in model.parameters()]
    _run(LOOP[0].code, namespace)
    assert math.isfinite(namespace["loss"].item()), f"{what}: loss {namespace['loss'].item()}"
    assert getattr(optimizer, "skipped_steps", 0) == skipped, f"{what}: the page's step was skipped"
    with torch.no_grad():
        unchanged = [name for (name, p), b in zip(model.named_parameters(), before) if torch.equal(p.float(), b)]
    assert not unchanged, f"{what}: one step left {unchanged} unchanged"


def _recipes(namespace: dict) -> dict[str, amp8.Recipe]:
    """Every recipe a block defines, by name, those in dicts too."""
    found = {}
    for name, value in namespace.items():
        if isinstance(value, amp8.Recipe):
            found[name] = value
        elif isinstance(value, dict):
            found.update({f"{name}[{key!r}]": item for key, item in value.items() if isinstance(item, amp8.Recipe)})
    return found


def test_the_page_has_one_loop_and_amp8_blocks_in_every_section() -> None:
    assert len(LOOP) == 1, f"{len(LOOP)} blocks marked loop"
    sections = {block.section for block in BLOCKS if block.section != "intro"}
    assert sections == {"MS-AMP", "apex amp", "torchao float8", "Transformer Engine"}, sections
    for section in sections:
        assert any(block.section == section for block in AMP8), f"no amp8 block under {section}"
        assert any(block.section == section and block.level is None for block in BLOCKS), (
            f"no block of the other library under {section}"
        )
    assert {"O1", "O2", "O3", "O1-compute"} <= {block.level for block in AMP8}


def test_blocks_are_either_amp8_or_marked_as_another_library() -> None:
    levels = set(FP8_LEVELS + KEEPS_OPTIMIZER)
    for block in BLOCKS:
        if block.level is None:
            assert block.code.lstrip().startswith(LIBRARIES), f"unmarked block that is not amp8's:\n{block.code}"
        else:
            assert block.level == "loop" or block.level in levels, f"unknown level in marker: {block.level}"
            assert not OTHER_IMPORTS.search(block.code), f"an amp8 block imports another library:\n{block.code}"
            assert not block.code.lstrip().startswith(LIBRARIES), f"another library's block marked amp8:\n{block.code}"


@pytest.mark.parametrize("block", AMP8, ids=[block.id for block in AMP8])
def test_amp8_block_runs_and_trains(block: Block) -> None:
    model, optimizer = _model_and_optimizer()
    x, y = _batch()
    namespace = {"torch": torch, "nn": nn, "amp8": amp8, "model": model, "optimizer": optimizer, "x": x, "y": y}
    _run(block.code, namespace)
    high = set(filter(None, block.options.get("high", "").split(",")))
    _train_and_check(namespace, block.level, high, optimizer, block.id)

    # Each recipe the block names (a table of another library's recipes) trains at the
    # block's level too, not only the one the block passes to initialize.
    for name, recipe in _recipes(namespace).items():
        model, optimizer = _model_and_optimizer()
        model, returned = amp8.initialize(model, optimizer, opt_level=block.level, recipe=recipe)
        ns = {"torch": torch, "amp8": amp8, "model": model, "optimizer": returned, "x": x, "y": y}
        _train_and_check(ns, block.level, high, optimizer, f"{block.id} {name}")


def test_an_overflowing_step_is_skipped_as_the_page_says() -> None:
    """The apex section's claim, beyond its block's own assert: the bad step changes no weight."""
    (block,) = [b for b in AMP8 if "skipped_steps" in b.code]
    model, optimizer = _model_and_optimizer()
    x, y = _batch()
    namespace = {"torch": torch, "amp8": amp8, "model": model, "optimizer": optimizer, "x": x, "y": y}
    _run(block.code, namespace)
    assert namespace["optimizer"].skipped_steps == 1
    fresh, _ = amp8.initialize(*_model_and_optimizer(), opt_level=block.level)  # the same weights, unstepped
    with torch.no_grad():
        for (name, p), q in zip(namespace["model"].named_parameters(), fresh.parameters()):
            assert torch.equal(p.float(), q.float()), f"{name} changed in a skipped step"
