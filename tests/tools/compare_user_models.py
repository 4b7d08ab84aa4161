"""Three models of the kind a new user brings to ``amp8 compare``, each with its data and
loss, small enough to train at O0-O3 in about a second: a ViT classifier on random
images, a BERT-style sequence classifier on random tokens (batches are dicts and the
model returns an output with ``.loss``, the default loss), and an MLP regression with an
MSE loss. Widths are multiples of 16, so amp8 swaps their Linear layers to FP8.

The CLI tests name them as ``path/to/compare_user_models.py:build_vit`` and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 32
BATCHES = 4
BATCH = 8


class Block(nn.Module):
    """A pre-norm transformer encoder block of Linear layers: attention, then an MLP."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn_mask = None if mask is None else mask[:, None, None, :].bool()  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyViT(nn.Module):
    """Patches of a (B, 3, 16, 16) image embedded by a Linear, two encoder blocks, a
    class token, a 10-way head."""

    def __init__(self, patch: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(3 * patch * patch, WIDTH)
        self.cls = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 1 + (16 // patch) ** 2, WIDTH))
        self.blocks = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(images, self.patch, stride=self.patch).transpose(1, 2)  # (B, N, 3*p*p)
        x = torch.cat([self.cls.expand(len(images), -1, -1), self.embed(patches)], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build_vit() -> nn.Module:
    return TinyViT()


def _image_batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 16, 16, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
            for _ in range(count)]


vit_data = _image_batches(0, BATCHES)
vit_eval = _image_batches(1, 2)


def vit_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


@dataclass
class ClassifierOutput:
    """What the BERT-style model returns, as transformers models do: ``.loss``, ``.logits``."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyBert(nn.Module):
    """Token and position embeddings, two encoder blocks under an attention mask, the
    first token pooled through a Linear and tanh, a 2-way classifier."""

    def __init__(self, vocab: int = 64, length: int = 16) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, WIDTH), nn.Embedding(length, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.pool = nn.Linear(WIDTH, WIDTH)
        self.classifier = nn.Linear(WIDTH, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> ClassifierOutput:
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x, attention_mask)
        logits = self.classifier(torch.tanh(self.pool(x[:, 0])))
        return ClassifierOutput(None if labels is None else F.cross_entropy(logits, labels), logits)


def build_bert() -> nn.Module:
    return TinyBert()


def _token_batches(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 64, (BATCH, 16), generator=generator)
        mask = torch.ones_like(ids)
        mask[:, 12:] = 0  # padding at the end
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": (ids[:, 1] % 2)})
    return batches


bert_data = _token_batches(0, BATCHES)
bert_eval = _token_batches(1, 2)


def build_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))


def _regression_batches(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(16, generator=torch.Generator().manual_seed(99))
    xs = [torch.randn(BATCH, 16, generator=generator) for _ in range(count)]
    return [(x, (x @ weights)[:, None]) for x in xs]


mlp_data = _regression_batches(0, BATCHES)
mlp_eval = _regression_batches(1, 2)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)  # type: ignore[arg-type]


USER_MODELS = {
    # name: (model builder, data, eval data, loss or None for model(**batch).loss)
    "vit": ("build_vit", "vit_data", "vit_eval", "vit_loss"),
    "bert": ("build_bert", "bert_data", "bert_eval", None),
    "mlp-mse": ("build_mlp", "mlp_data", "mlp_eval", "mse_loss"),
}
"""Each model's objects by name in this module, as the CLI names them."""
