"""A zoo of tiny transformers models, one or more per architecture family, for tests that run
amp8 on the models people load: each is built from its config alone (no download), two
layers wide 64 or so, vocabularies of 128, every GEMM dimension a multiple of 16 so that
amp8's FP8 GEMMs apply, with a batch that carries labels, so the model computes its own
loss.

``ZOO`` maps a name to a ``ZooModel``: the class names (looked up in the installed
transformers when built), the config fields (stable ones, present since transformers 4.46)
and the kind of batch the model takes. ``timm_vit`` builds timm's Vision Transformer
at the same size, or ``TimmStyleViT``, the same model in plain torch, where timm cannot be
imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 128
HIDDEN = 64
FFN = 128
HEADS = 4
POSITIONS = 64
BATCH = 2
TOKENS = 16
IMAGE = 32  # pixels a side; patches of 8: 16 patches
CHANNELS = 3
LABELS = 16  # classes of the image classifiers: a multiple of 16, so their heads run in FP8 too
MEL_BINS = 16
AUDIO_FRAMES = 32  # Whisper's encoder halves it: 16 positions

DECODER = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
    max_position_embeddings=POSITIONS,
)
"""The fields Llama-style decoders share."""


@dataclass(frozen=True)
class ZooModel:
    """One architecture of the zoo.

    Attributes:
        family: what kind of model it is (decoder, encoder, encoder-decoder, vision,
            speech, MoE, state-space), for reading the results.
        model_class: the transformers class to build and to ``from_pretrained`` into.
        config_class: its config's class.
        config: the config's fields.
        batch: "causal" (token ids, labels the same ids), "masked" (token ids, labels the
            same ids: every position predicted), "seq2seq" (encoder ids and decoder
            labels), "image" (pixels and class labels) or "speech" (log-mel features and
            decoder labels).
    """

    family: str
    model_class: str
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    batch: str = "causal"

    def build(self, seed: int = 0) -> nn.Module:
        """The model, built from its config after ``torch.manual_seed(seed)``."""
        import transformers

        config = getattr(transformers, self.config_class)(**self.config)
        torch.manual_seed(seed)
        return getattr(transformers, self.model_class)(config)

    def make_batch(self, seed: int = 1) -> dict[str, torch.Tensor]:
        """A batch of ``BATCH`` examples, labels included, from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
        if self.batch in ("causal", "masked"):
            return {"input_ids": ids, "labels": ids.clone()}
        if self.batch == "seq2seq":
            labels = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
            return {"input_ids": ids, "labels": labels}
        if self.batch == "image":
            pixels, labels = image_batch(seed)
            return {"pixel_values": pixels, "labels": labels}
        if self.batch == "speech":
            features = torch.randn(BATCH, MEL_BINS, AUDIO_FRAMES, generator=generator)
            return {"input_features": features, "labels": ids}
        raise ValueError(f"ZooModel.batch={self.batch!r} is not valid; use causal, masked, seq2seq, image or speech")


ZOO: dict[str, ZooModel] = {
    "llama": ZooModel("decoder", "LlamaForCausalLM", "LlamaConfig", dict(**DECODER, num_key_value_heads=2)),
    "qwen2": ZooModel("decoder", "Qwen2ForCausalLM", "Qwen2Config", dict(**DECODER, num_key_value_heads=2)),
    "phi": ZooModel("decoder", "PhiForCausalLM", "PhiConfig", dict(DECODER)),
    "gpt2": ZooModel("decoder", "GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=2, n_head=HEADS, bos_token_id=0,
        eos_token_id=0,
    )),
    "gpt-neox": ZooModel("decoder", "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(DECODER)),
    "falcon": ZooModel("decoder", "FalconForCausalLM", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
    )),
    "opt": ZooModel("decoder", "OPTForCausalLM", "OPTConfig", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
        max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN,
    )),
    "bert": ZooModel("encoder", "BertForMaskedLM", "BertConfig", dict(DECODER), batch="masked"),
    "distilbert": ZooModel("encoder", "DistilBertForMaskedLM", "DistilBertConfig", dict(
        vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN, n_layers=2, n_heads=HEADS, max_position_embeddings=POSITIONS,
    ), batch="masked"),
    "t5": ZooModel("encoder-decoder", "T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=2, num_heads=HEADS,
        decoder_start_token_id=0,
    ), batch="seq2seq"),
    "bart": ZooModel("encoder-decoder", "BartForConditionalGeneration", "BartConfig", dict(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=POSITIONS,
    ), batch="seq2seq"),
    "vit": ZooModel("vision", "ViTForImageClassification", "ViTConfig", dict(
        image_size=IMAGE, patch_size=8, num_channels=CHANNELS, hidden_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=HEADS, intermediate_size=FFN, num_labels=LABELS,
    ), batch="image"),
    "convnext": ZooModel("vision", "ConvNextForImageClassification", "ConvNextConfig", dict(
        image_size=IMAGE, num_channels=CHANNELS, patch_size=4, num_stages=2, hidden_sizes=[32, 64], depths=[1, 1],
        num_labels=LABELS,
    ), batch="image"),
    "whisper": ZooModel("speech", "WhisperForConditionalGeneration", "WhisperConfig", dict(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_source_positions=AUDIO_FRAMES // 2, max_target_positions=POSITIONS, decoder_start_token_id=0,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    ), batch="speech"),
    "mixtral": ZooModel("moe", "MixtralForCausalLM", "MixtralConfig", dict(
        **DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )),
    "mamba": ZooModel("state-space", "MambaForCausalLM", "MambaConfig", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=16,
    )),
}
"""The zoo: at least one architecture of every family amp8 is used on."""


# -- a Vision Transformer as timm lays it out ----------------------------------------------

TIMM_VIT = dict(img_size=IMAGE, patch_size=8, in_chans=CHANNELS, embed_dim=HIDDEN, depth=2, num_heads=HEADS,
                mlp_ratio=FFN / HIDDEN, num_classes=LABELS)
"""timm's ``VisionTransformer`` arguments for the zoo's ViT (``TimmStyleViT`` takes the same)."""


class _PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, C)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, width // self.num_heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(*qkv.unbind(0))  # (B, heads, T, head_dim)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmStyleViT(nn.Module):
    """timm's ``VisionTransformer`` in its default form, in plain torch: the same module
    names and parameter names (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
    ``blocks.N.attn.qkv``, ``blocks.N.mlp.fc1``, ``norm``, ``head``), the fused qkv
    projection, scaled dot-product attention and a class-token head; so amp8 sees what it
    sees in timm's model where timm cannot be imported."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int,
                 mlp_ratio: float, num_classes: int) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*(_Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # (B, patches, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])  # (B, classes)


def timm_vit(use_timm: bool, seed: int = 0) -> nn.Module:
    """The zoo's ViT, built after ``torch.manual_seed(seed)``: timm's own
    ``VisionTransformer`` with ``use_timm``, else ``TimmStyleViT``."""
    torch.manual_seed(seed)
    if use_timm:
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(**TIMM_VIT)
    return TimmStyleViT(**TIMM_VIT)


def image_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixels, labels)``: a batch of ``BATCH`` images of the zoo's vision models."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=generator)
    return pixels, torch.randint(0, LABELS, (BATCH,), generator=generator)
