"""Real text corpora on every machine, shipped with Python itself.

Two sources (``CorpusConfig.source``), each a list of documents sorted by name:

- ``"stdlib"``: the ``*.py`` files directly in ``sysconfig.get_paths()["stdlib"]`` (code);
- ``"docs"``: the topics of the Python language reference that ``help()`` prints
  (``pydoc_data.topics``, English prose with code examples), sorted by topic and cut
  into documents of whole paragraphs of at least ``DOC_PIECE_BYTES`` bytes each (the
  topics range from 200 bytes to 60 KB; whole topics would make the validation split
  a few small topics, and its loss depend on which).

Every ``holdout_every``-th document (by sorted index, counting from the last of each
group) is held out for validation, so the validation split is whole documents the model
never trains on. Each split is the concatenation of its documents' bytes, cut to its
share of ``max_bytes``. Tokens are bytes (vocabulary 256). The corpora differ between
Python versions; ``ByteCorpus.describe()`` records the version, the document count and a
SHA-256 of the bytes so runs can be matched.
"""

from __future__ import annotations

import hashlib
import importlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

VOCAB_SIZE = 256
"""Byte-level tokens."""

Document = tuple[str, bytes]
"""A document's name and bytes."""

DOC_PIECE_BYTES = 4096
"""The least size of a ``"docs"`` document (a topic's last piece may be smaller)."""


@dataclass(frozen=True)
class CorpusConfig:
    """Which bytes the corpus holds.

    Attributes:
        max_bytes: budget for both splits together.
        holdout_every: every n-th document goes to validation (n >= 2).
        root: directory to read ``*.py`` files from; None for the standard library's
            (``"stdlib"`` source only).
        source: ``"stdlib"`` (the standard library's code) or ``"docs"`` (the language
            reference's prose); see ``SOURCES``.
    """

    max_bytes: int = 2 * 1024 * 1024
    holdout_every: int = 10
    root: str | None = None
    source: str = "stdlib"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(
                f"CorpusConfig.source={self.source!r} is not valid; use one of {', '.join(map(repr, SOURCES))}"
            )
        if self.root is not None and self.source != "stdlib":
            raise ValueError(
                f"CorpusConfig.root is read by source='stdlib' only; drop root or use source='stdlib' "
                f"(got source={self.source!r})"
            )
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


def stdlib_documents(config: CorpusConfig) -> list[Document]:
    """The ``*.py`` files of ``config.root`` (default: the standard library), by name."""
    root = Path(config.root) if config.root is not None else stdlib_root()
    return [(str(path), path.read_bytes()) for path in source_files(root)]


def docs_documents(config: CorpusConfig) -> list[Document]:
    """The language reference's topics as ``help()`` prints them, by topic name, each
    cut into pieces of whole paragraphs (``DOC_PIECE_BYTES``), named ``topic#index``."""
    try:
        topics: Mapping[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ModuleNotFoundError:
        raise FileNotFoundError(
            "this Python ships without pydoc_data (the documentation help() prints); "
            "use CorpusConfig(source='stdlib')"
        ) from None
    return [piece for name in sorted(topics) for piece in _pieces(name, topics[name].encode("utf-8"))]


def _pieces(name: str, text: bytes) -> list[Document]:
    """``text`` cut after paragraphs (blank lines) once a piece holds ``DOC_PIECE_BYTES``."""
    pieces: list[Document] = []
    current = b""
    for paragraph in text.split(b"\n\n"):
        current = current + b"\n\n" + paragraph if current else paragraph
        if len(current) >= DOC_PIECE_BYTES:
            pieces.append((f"{name}#{len(pieces)}", current))
            current = b""
    if current:
        pieces.append((f"{name}#{len(pieces)}", current))
    return pieces


SOURCES: Mapping[str, tuple[str, Callable[[CorpusConfig], list[Document]]]] = {
    "stdlib": ("*.py files directly in the Python standard library directory, sorted by name",
               stdlib_documents),
    "docs": ("topics of the Python language reference (pydoc_data.topics, what help() prints), "
             f"sorted by name, in pieces of whole paragraphs of at least {DOC_PIECE_BYTES} bytes",
             docs_documents),
}
"""Each source's description (for ``ByteCorpus.describe``) and its document reader."""


@dataclass(frozen=True)
class ByteCorpus:
    """Train and validation bytes as 1-D ``torch.uint8`` tensors, with their provenance."""

    train: torch.Tensor
    val: torch.Tensor
    root: str | None  # the directory read, None for the standard library (no local paths in results)
    train_files: int
    val_files: int
    sha256: str
    source: str = "stdlib"

    def describe(self) -> dict[str, Any]:
        """Where the bytes come from, for logs and JSON."""
        return {
            "corpus": self.source,
            "source": SOURCES[self.source][0],
            "root": self.root,
            "python": platform.python_version(),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "train_files": self.train_files,
            "val_files": self.val_files,
            "sha256": self.sha256,
        }


def _join(documents: list[Document], budget: int) -> tuple[bytes, int]:
    """Concatenate documents (each followed by a newline) up to ``budget`` bytes."""
    parts: list[bytes] = []
    size = used = 0
    for _, text in documents:
        if size >= budget:
            break
        data = text + b"\n"
        parts.append(data)
        size += len(data)
        used += 1
    return b"".join(parts)[:budget], used


def load_corpus(config: CorpusConfig = CorpusConfig()) -> ByteCorpus:
    """Read the corpus ``config`` describes.

    Raises:
        FileNotFoundError: when the source holds fewer than ``holdout_every`` documents
            (a directory without ``*.py`` files, a Python without ``pydoc_data``).
    """
    root = str(Path(config.root) if config.root is not None else stdlib_root())
    files = SOURCES[config.source][1](config)
    if len(files) < config.holdout_every:
        where = f"*.py files in {root}" if config.source == "stdlib" else f"{config.source!r} documents"
        raise FileNotFoundError(
            f"found {len(files)} {where}, need at least {config.holdout_every}; "
            "pass CorpusConfig(root=...) pointing at a directory of Python sources"
        )
    n = config.holdout_every
    val_files = [doc for index, doc in enumerate(files) if index % n == n - 1]
    train_files = [doc for index, doc in enumerate(files) if index % n != n - 1]
    val_budget = max(config.max_bytes // n, 1)
    train_bytes, train_used = _join(train_files, config.max_bytes - val_budget)
    val_bytes, val_used = _join(val_files, val_budget)
    digest = hashlib.sha256(train_bytes + b"\0" + val_bytes).hexdigest()
    return ByteCorpus(
        train=torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8),
        root=config.root if config.source == "stdlib" else "pydoc_data.topics",
        train_files=train_used,
        val_files=val_used,
        sha256=digest,
        source=config.source,
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
