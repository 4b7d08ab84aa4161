"""A zoo of tiny transformers models, one per architecture family, for tests that run
amp8 on the models people load: each is built from its config alone (no download), two
layers wide 64 or so, vocabularies of 128, every GEMM dimension a multiple of 16 so that
amp8's FP8 GEMMs apply, with a batch that carries labels, so the model computes its own
loss.

``ZOO`` maps a name to a ``ZooModel``: the class names (looked up in the installed
transformers when built), the config fields (stable ones, present since transformers 4.46)
and the kind of batch the model takes.
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
            pixels = torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=generator)
            return {"pixel_values": pixels, "labels": torch.randint(0, LABELS, (BATCH,), generator=generator)}
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
