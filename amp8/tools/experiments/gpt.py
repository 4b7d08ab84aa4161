"""A small byte-level GPT in the style of nanoGPT, built from ``nn.Linear`` so amp8 can
run its projections in FP8.

Token embedding and learned positions, pre-norm blocks (causal self-attention whose qkv
and output projections are ``nn.Linear``, then an MLP of two ``nn.Linear``), a final
LayerNorm, and a head that is tied to the token embedding (the presets) or a Linear of
its own (``tie_head=False``, as in most Llama-style models).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from amp8.quant.scale_layout import GEMM_ALIGNMENT
from amp8.tools.experiments.corpus import VOCAB_SIZE



def check_sizes(config: object, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless each of ``config``'s fields ``names`` is an int >= 1;
    the message names the class, the field and its value."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name}={value!r} is not valid; use an int >= 1")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT.

    Attributes:
        n_layer: transformer blocks.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: width; a multiple of 16 so every projection can run in FP8.
        block_size: context length in bytes.
        vocab_size: 256 for bytes.
        tie_head: the output head shares the token embedding's weight (nanoGPT, GPT-2);
            False gives it a weight of its own, as most Llama-style models have.
    """

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = VOCAB_SIZE
    tie_head: bool = True

    def __post_init__(self) -> None:
        check_sizes(self, ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"))
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick a head count that divides the width"
            )
        if self.n_embd % GEMM_ALIGNMENT:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not a multiple of {GEMM_ALIGNMENT}; FP8 GEMMs "
                f"need multiples of {GEMM_ALIGNMENT}, e.g. n_embd={GEMM_ALIGNMENT * max(1, round(self.n_embd / GEMM_ALIGNMENT))}"
            )
        if not isinstance(self.tie_head, bool):
            raise ValueError(f"GPTConfig.tie_head={self.tie_head!r} is not valid; use True or False")

    @property
    def name(self) -> str:
        """The shape in a few words, e.g. "GPT 2x128 (ctx 64, untied head)"."""
        head = "" if self.tie_head else ", untied head"
        return f"GPT {self.n_layer}x{self.n_embd} (ctx {self.block_size}{head})"

    def build(self, generator: torch.Generator | None = None) -> "GPT":
        """A ``GPT`` of this shape with initial weights drawn from ``generator``."""
        return GPT(self, generator)

    @classmethod
    def from_preset(cls, name: str) -> "GPTConfig":
        """The config of a named preset (see ``PRESETS``).

        Raises:
            ValueError: for an unknown name, listing the valid ones.
        """
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} is not known; use one of {', '.join(map(repr, PRESETS))}")
        return PRESETS[name]


PRESETS: Mapping[str, GPTConfig] = MappingProxyType({
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64),
    "small": GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64),
    "medium": GPTConfig(n_layer=6, n_head=8, n_embd=384, block_size=256),
    "gpt-125m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt-1b": GPTConfig(n_layer=20, n_head=16, n_embd=2048, block_size=1024),
})
"""Named shapes: "tiny" for tests, "small" the CPU default, "medium", "gpt-125m" and
"gpt-1b" (1.01e9 parameters, 99.7 % of them in FP8-eligible projections) for GPUs."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with ``nn.Linear`` projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions; ``x`` is (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class MLP(nn.Module):
    """Two ``nn.Linear`` with a GELU between, 4x wide."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The byte-level GPT; ``forward(idx, targets)`` returns ``(logits, loss)``.

    Args:
        config: the shape.
        generator: random source of the initial weights (nanoGPT's: normal with std 0.02,
            residual projections scaled by ``1 / sqrt(2 * n_layer)``, zero biases). With a
            generator the global random state is left as it was; without one, torch's
            global generator draws the weights.
    """

    def __init__(self, config: GPTConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        # torch's layers draw a default init from the global generator; fork it so building
        # a GPT leaves the caller's random state as it was (reset_parameters redraws all).
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
            self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd)
            self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_head:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the initial weights from ``generator``."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module.weight is self.tok_emb.weight:
                    continue
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for byte ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given.

        Raises:
            ValueError: when T exceeds the block size.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}; "
                "crop the input or build the GPT with a larger block_size"
            )
        positions = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss
