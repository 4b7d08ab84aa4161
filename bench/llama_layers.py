"""A decoder whose layers have Llama-3's shapes, for bench/gpt.py's wider presets.

amp8's byte-level GPT (amp8/tools/experiments/gpt.py) has a 4x GELU MLP and as many key
and value heads as query heads; Llama-3-8B's layers are wider and shaped otherwise. This
model has them: RMSNorm, separate q, k, v and o projections with grouped-query attention
(``n_kv_head`` key/value heads) and rotary positions, and a SwiGLU MLP (gate, up, down).
It keeps the GPT's interface: ``forward(idx, targets) -> (logits, loss)``, the blocks in
``.blocks`` (compiled one by one), byte tokens (vocab 256) and an untied head.

The vocabulary is the one difference from Llama-3-8B kept on purpose: its 128256-entry
head would be a third of a four-layer model's GEMM work, against 7 % of the real 32 layers,
and would hide the layers' speed-up; here the head is negligible, so the step measures the
layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
from torch import nn
from torch.nn import functional as F

GEMM_ALIGNMENT = 16  # FP8 GEMMs need K and N in multiples of 16


@dataclass(frozen=True)
class LlamaShapedConfig:
    """Shape of the Llama-shaped decoder.

    Attributes:
        n_layer: decoder blocks.
        n_head: query heads; must divide ``n_embd``.
        n_kv_head: key and value heads; must divide ``n_head``.
        n_embd: width.
        mlp_hidden: width of the SwiGLU MLP's gate and up projections.
        block_size: context length.
        vocab_size: 256 for bytes.
        rope_theta: base of the rotary position angles (Llama-3: 500000).
    """

    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 64
    mlp_hidden: int = 224
    block_size: int = 64
    vocab_size: int = 256
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaShapedConfig.{name}={value!r} is not valid; use an int >= 1")
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaShapedConfig: n_head={self.n_head} must divide n_embd={self.n_embd} and "
                f"n_kv_head={self.n_kv_head} must divide n_head; pick head counts that divide"
            )
        widths = {"n_embd": self.n_embd, "mlp_hidden": self.mlp_hidden, "kv width": self.kv_width}
        for name, width in widths.items():
            if width % GEMM_ALIGNMENT:
                raise ValueError(
                    f"LlamaShapedConfig: {name} {width} is not a multiple of {GEMM_ALIGNMENT}, "
                    "which FP8 GEMMs need; round it to one"
                )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def kv_width(self) -> int:
        """Output width of the k and v projections."""
        return self.n_kv_head * self.head_dim

    def build(self, generator: torch.Generator | None = None) -> "LlamaShaped":
        """A ``LlamaShaped`` of this shape with initial weights drawn from ``generator``."""
        return LlamaShaped(self, generator)


PRESETS: Mapping[str, LlamaShapedConfig] = MappingProxyType({
    # Llama-3-8B's layers (width 4096, MLP 14336, 32 query and 8 key/value heads) at the
    # context torchtitan trains it with, four of them: 0.87e9 parameters.
    "llama3-8b-layers": LlamaShapedConfig(
        n_layer=4, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, block_size=8192
    ),
    "llama-tiny": LlamaShapedConfig(),  # the same layout at test size
})


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: rotate each pair (first half, second half) of ``x``'s head
    dimension by its position's angle; ``x`` is (B, H, T, D), ``cos`` and ``sin`` (T, D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class LlamaBlock(nn.Module):
    """Pre-norm residual block: grouped-query attention, then a SwiGLU MLP."""

    def __init__(self, config: LlamaShapedConfig) -> None:
        super().__init__()
        self.config = config
        width, kv = config.n_embd, config.kv_width
        self.attn_norm = nn.RMSNorm(width, eps=1e-5)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv, bias=False)
        self.v = nn.Linear(width, kv, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=1e-5)
        self.gate = nn.Linear(width, config.mlp_hidden, bias=False)
        self.up = nn.Linear(width, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        c = self.config
        B, T, C = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(B, T, c.n_head, c.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = (p(h).view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2) for p in (self.k, self.v))  # (B, KV, T, D)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        repeat = c.n_head // c.n_kv_head  # each key/value head serves `repeat` query heads
        k, v = (t[:, :, None].expand(B, c.n_kv_head, repeat, T, c.head_dim).reshape(B, c.n_head, T, c.head_dim)
                for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaShaped(nn.Module):
    """The decoder; ``forward(idx, targets)`` returns ``(logits, loss)`` as the GPT does.

    Args:
        config: the shape.
        generator: random source of the initial weights (normal, std 0.02; the o and down
            projections scaled by ``1 / sqrt(2 * n_layer)``).
    """

    def __init__(self, config: LlamaShapedConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=1e-5)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        half = config.head_dim // 2
        inverse = config.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)  # (D/2,)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float32), inverse)  # (T, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Draw the initial weights from ``generator``."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith((".o", ".down")) else 0.02
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}; crop the input")
        x = self.tok_emb(idx)  # (B, T, C)
        cos, sin = self.cos[:T], self.sin[:T]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss
