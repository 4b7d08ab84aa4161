"""``amp8 compare --hf-config NAME_OR_PATH --data FILE ...``: a transformers causal LM
built from a config (nothing is downloaded) trained byte-level on the user's text files.

The config is a local one (a folder holding ``config.json``, or the file itself) or a
transformers model type ("llama", "gpt2", "mistral", ...), which is built with
``AutoConfig.for_model`` at the shape given (``HfShape``: a small one by default, not
the model type's full size). The text is read as bytes, so the model's vocabulary must
hold 256 ids; a model type's is set to 256.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

BYTES = 256
HOLDOUT_EVERY = 10
"""Every 10th window-sized piece of the text is held out for validation."""
_TRAIN_SEED, _VAL_SEED = 0, 1234


@dataclass(frozen=True)
class HfShape:
    """The shape a transformers model type is built at (a local config keeps its own).

    Attributes:
        n_layer, n_embd, n_head: layers, width and attention heads (key/value heads as
            many as heads); the MLP is 4x the width.
        block_size: context length of a training window.
    """

    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64


def hf_config(name_or_path: str, shape: HfShape) -> Any:
    """The transformers config ``name_or_path`` names: a local folder or ``config.json``,
    or a model type built at ``shape`` with a byte vocabulary.

    Raises:
        ModuleNotFoundError: transformers is not installed, saying how to get it.
        ValueError: neither a local config nor a model type transformers knows.
    """
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "--hf-config builds a transformers model and transformers is not installed; "
            "install it with pip install 'amp8[hf]'"
        ) from None
    path = Path(name_or_path)
    if path.exists():
        folder = path.parent if path.is_file() else path
        if not (folder / "config.json").is_file() and not path.is_file():
            raise ValueError(f"--hf-config {name_or_path!r} is a folder without config.json; point it at a model's "
                             "config folder or its config.json")
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    if name_or_path not in CONFIG_MAPPING:
        known = ", ".join(name for name in ("llama", "gpt2", "mistral", "qwen2") if name in CONFIG_MAPPING)
        raise ValueError(
            f"--hf-config {name_or_path!r} is neither a local config (a folder with config.json, or the file) "
            f"nor a transformers model type (e.g. {known}); nothing is downloaded"
        )
    config = AutoConfig.for_model(name_or_path)
    changes = {"num_hidden_layers": shape.n_layer, "hidden_size": shape.n_embd, "num_attention_heads": shape.n_head,
               "vocab_size": BYTES, "intermediate_size": 4 * shape.n_embd, "num_key_value_heads": shape.n_head,
               "max_position_embeddings": max(shape.block_size, 128), "n_inner": 4 * shape.n_embd}
    for key, value in changes.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if hasattr(config, "head_dim"):
        config.head_dim = shape.n_embd // shape.n_head
    return config


class HfCausalLM:
    """A picklable factory of ``AutoModelForCausalLM.from_config(config)`` (fresh weights
    each call, drawn from torch's generator)."""

    def __init__(self, config: Any) -> None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        self.config = config
        self.__qualname__ = f"AutoModelForCausalLM({type(config).__name__})"
        self.__module__ = "transformers"
        if getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                f"--hf-config builds a causal LM for --data text files, and transformers has none for "
                f"{type(config).__name__}; for other models use --model module:build_model"
            )
        if getattr(config, "vocab_size", BYTES) < BYTES:
            raise ValueError(f"--hf-config's vocab_size={config.vocab_size} cannot hold the {BYTES} byte values the "
                             "text is read as; use a config with vocab_size >= 256")

    def __call__(self) -> nn.Module:
        """A fresh model of the config."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config)


def read_text(paths: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of ``paths`` (in the order given) as train and validation tokens: every
    ``HOLDOUT_EVERY``-th piece of 4 KiB is held out.

    Raises:
        FileNotFoundError: a path that is not a file, naming it.
        ValueError: no text at all.
    """
    chunks = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--data {name!r} is not a file; with --hf-config, --data takes text files")
        chunks.append(path.read_bytes())
    data = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()
    if data.numel() < 2:
        raise ValueError(f"--data {', '.join(paths)} holds no text; give text files to train on")
    pieces = list(data.split(4096))
    val = [piece for index, piece in enumerate(pieces) if index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [piece for index, piece in enumerate(pieces) if index % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    return torch.cat(train), torch.cat(val) if val else torch.cat(train)


class TextBatches(collections.abc.Iterable):  # type: ignore[type-arg]
    """``count`` batches of ``batch_size`` random windows of ``block_size + 1`` bytes of
    ``tokens``, as ``{"input_ids", "labels"}`` (a causal LM shifts the labels itself),
    the same windows on every pass (drawn from a generator seeded with ``seed``)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, count: int, seed: int) -> None:
        if tokens.numel() <= block_size:
            raise ValueError(f"the text holds {tokens.numel()} bytes, fewer than a window of block_size={block_size}; "
                             "give more text or a smaller --block-size")
        self.tokens, self.batch_size, self.block_size, self.count, self.seed = tokens, batch_size, block_size, count, seed

    def __len__(self) -> int:
        """The batches of one pass."""
        return self.count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """One pass: the same windows every time."""
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.count):
            starts = torch.randint(0, self.tokens.numel() - self.block_size, (self.batch_size,), generator=generator)
            ids = torch.stack([self.tokens[start:start + self.block_size] for start in starts.tolist()])
            yield {"input_ids": ids, "labels": ids}


def text_data(paths: Sequence[str], batch_size: int, block_size: int, steps: int,
              eval_batches: int = 8) -> tuple[TextBatches, TextBatches]:
    """Training batches (``steps`` of them) and validation batches (``eval_batches``) of
    the text files ``paths``, byte-level."""
    train, val = read_text(paths)
    return (TextBatches(train, batch_size, block_size, steps, _TRAIN_SEED),
            TextBatches(val, batch_size, block_size, eval_batches, _VAL_SEED))
