"""A real text corpus on every machine: the Python standard library's own source files.

Selection (deterministic for a given Python version): the ``*.py`` files directly in
``sysconfig.get_paths()["stdlib"]``, sorted by name. Every ``holdout_every``-th file (by
sorted index, counting from the last of each group) is held out for validation, so the
validation split is whole files the model never trains on. Each split is the
concatenation of its files' bytes, cut to its share of ``max_bytes``. Tokens are bytes
(vocabulary 256). The corpus differs between Python versions; ``ByteCorpus.describe()``
records the version, the file count and a SHA-256 of the bytes so runs can be matched.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 256
"""Byte-level tokens."""


@dataclass(frozen=True)
class CorpusConfig:
    """Which bytes the corpus holds.

    Attributes:
        max_bytes: budget for both splits together.
        holdout_every: every n-th file goes to validation (n >= 2).
        root: directory to read ``*.py`` files from; None for the standard library's.
    """

    max_bytes: int = 2 * 1024 * 1024
    holdout_every: int = 10
    root: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1024:
            raise ValueError(f"CorpusConfig.max_bytes={self.max_bytes!r} is not valid; use an int >= 1024")
        if isinstance(self.holdout_every, bool) or not isinstance(self.holdout_every, int) or self.holdout_every < 2:
            raise ValueError(
                f"CorpusConfig.holdout_every={self.holdout_every!r} is not valid; use an int >= 2"
            )


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The ``*.py`` files directly in ``root``, sorted by name."""
    return sorted(path for path in root.glob("*.py") if path.is_file())


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation bytes as 1-D ``torch.uint8`` tensors, with their provenance."""

    train: torch.Tensor
    val: torch.Tensor
    root: str
    train_files: int
    val_files: int
    sha256: str

    def describe(self) -> dict[str, Any]:
        """Where the bytes come from, for logs and JSON."""
        return {
            "source": "*.py files directly in the Python standard library directory, sorted by name",
            "root": self.root,
            "python": platform.python_version(),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "train_files": self.train_files,
            "val_files": self.val_files,
            "sha256": self.sha256,
        }


def _join(files: list[Path], budget: int) -> tuple[bytes, int]:
    """Concatenate files (each followed by a newline) up to ``budget`` bytes."""
    parts: list[bytes] = []
    size = used = 0
    for path in files:
        if size >= budget:
            break
        data = path.read_bytes() + b"\n"
        parts.append(data)
        size += len(data)
        used += 1
    return b"".join(parts)[:budget], used


def load_corpus(config: CorpusConfig = CorpusConfig()) -> ByteCorpus:
    """Read the corpus ``config`` describes.

    Raises:
        FileNotFoundError: when the directory holds no ``*.py`` files.
    """
    root = Path(config.root) if config.root is not None else stdlib_root()
    files = source_files(root)
    if len(files) < config.holdout_every:
        raise FileNotFoundError(
            f"found {len(files)} *.py files in {root}, need at least {config.holdout_every}; "
            "pass CorpusConfig(root=...) pointing at a directory of Python sources"
        )
    n = config.holdout_every
    val_files = [path for index, path in enumerate(files) if index % n == n - 1]
    train_files = [path for index, path in enumerate(files) if index % n != n - 1]
    val_budget = max(config.max_bytes // n, 1)
    train_bytes, train_used = _join(train_files, config.max_bytes - val_budget)
    val_bytes, val_used = _join(val_files, val_budget)
    digest = hashlib.sha256(train_bytes + b"\0" + val_bytes).hexdigest()
    return ByteCorpus(
        train=torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        root=str(root),
        train_files=train_used,
        val_files=val_used,
        sha256=digest,
    )


def sample_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs (B, T) and next-byte targets (B, T), int64.

    Raises:
        ValueError: when ``data`` is not longer than ``block_size``.
    """
    if data.numel() <= block_size:
        raise ValueError(
            f"the split holds {data.numel()} bytes, fewer than block_size + 1 = {block_size + 1}; "
            "raise CorpusConfig.max_bytes or lower the block size"
        )
    starts = torch.randint(data.numel() - block_size, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(block_size + 1)  # (T + 1,)
    windows = data[starts[:, None] + offsets].long()  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]
