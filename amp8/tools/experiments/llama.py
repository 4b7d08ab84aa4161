"""A small byte-level Llama, or its mixture-of-experts sibling Mixtral, from the
``transformers`` library, for studies on model families other than amp8's own GPT.

``LlamaSpec`` describes the shape; ``build`` makes a ``transformers``
``LlamaForCausalLM`` from config (RMSNorm, rotary positions, grouped-query attention,
a SiLU-gated MLP, and an output head of its own), or with ``n_expert`` set a
``MixtralForCausalLM`` (the same, with a routed mixture of SiLU-gated experts for the
MLP), wrapped so that ``forward(idx, targets)`` returns ``(logits, loss)`` as the GPT
does. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from amp8.quant.scale_layout import GEMM_ALIGNMENT
from amp8.tools.experiments.corpus import VOCAB_SIZE
from amp8.tools.experiments.gpt import check_sizes



def transformers_available() -> bool:
    """Whether ``transformers`` can be imported."""
    return importlib.util.find_spec("transformers") is not None


@dataclass(frozen=True)
class LlamaSpec:
    """Shape of the byte-level Llama.

    Attributes:
        n_layer: decoder layers.
        n_head: attention heads; must divide ``n_embd``.
        n_kv_head: key/value heads (grouped-query attention); must divide ``n_head``.
        n_embd: width; a multiple of 16.
        intermediate: the gated MLP's inner width; a multiple of 16.
        block_size: context length in bytes.
        vocab_size: 256 for bytes.
        tie_head: the head shares the token embedding's weight (False, as in Llama).
        n_expert: experts per MLP (0: a dense MLP, Llama; more: a Mixtral, each expert a
            gated MLP of width ``intermediate``).
        expert_top_k: experts each token is routed to, when ``n_expert`` is set.
    """

    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    intermediate: int = 352
    block_size: int = 64
    vocab_size: int = VOCAB_SIZE
    tie_head: bool = False
    n_expert: int = 0
    expert_top_k: int = 2

    def __post_init__(self) -> None:
        check_sizes(self, ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate", "block_size", "vocab_size"))
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaSpec n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}: "
                "n_head must divide n_embd and n_kv_head must divide n_head"
            )
        if self.n_expert and not 1 <= self.expert_top_k <= self.n_expert:
            raise ValueError(
                f"LlamaSpec expert_top_k={self.expert_top_k} with n_expert={self.n_expert}: route each "
                "token to between 1 and n_expert experts"
            )
        for name in ("n_embd", "intermediate"):
            if getattr(self, name) % GEMM_ALIGNMENT:
                raise ValueError(
                    f"LlamaSpec.{name}={getattr(self, name)} is not a multiple of {GEMM_ALIGNMENT}; "
                    "FP8 GEMMs need multiples of 16"
                )

    @classmethod
    def of_shape(cls, n_layer: int, n_head: int, n_embd: int, block_size: int) -> "LlamaSpec":
        """The Llama of a GPT's shape: Llama's own proportions for the rest, an MLP of
        8/3 ``n_embd`` (rounded up to a multiple of 16) and half as many key/value heads
        as heads (all of them when ``n_head`` is odd). ``LlamaSpec()`` is the Llama of
        the "small" GPT's shape.

        Raises:
            ValueError: a shape that is not valid, naming the field.
        """
        intermediate = -(-8 * n_embd // (3 * GEMM_ALIGNMENT)) * GEMM_ALIGNMENT
        n_kv_head = n_head // 2 if n_head % 2 == 0 else n_head
        return cls(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                   intermediate=intermediate, block_size=block_size)

    @property
    def name(self) -> str:
        """The shape in a few words, e.g. "Llama 2x128 (ctx 64, untied head)" or "Mixtral
        2x128 (8 experts, top 2, ctx 64, untied head)"."""
        head = "tied head" if self.tie_head else "untied head"
        if self.n_expert:
            experts = f"{self.n_expert} experts, top {self.expert_top_k}, "
            return f"Mixtral {self.n_layer}x{self.n_embd} ({experts}ctx {self.block_size}, {head})"
        return f"Llama {self.n_layer}x{self.n_embd} (ctx {self.block_size}, {head})"

    def build(self, generator: torch.Generator | None = None) -> "ByteLlama":
        """A ``ByteLlama`` of this shape with initial weights drawn from ``generator``.

        Raises:
            ModuleNotFoundError: when ``transformers`` is not installed, saying how to get it.
        """
        return ByteLlama(self, generator)


class ByteLlama(nn.Module):
    """``transformers``' ``LlamaForCausalLM`` (``MixtralForCausalLM`` where the spec has
    experts) over bytes; ``forward(idx, targets)`` returns ``(logits, loss)``.

    The weights are ``transformers``' own initialization (normal, std 0.02), drawn under
    a seed taken from ``generator``, so the caller's global random state is left as it was.
    """

    def __init__(self, spec: LlamaSpec, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not transformers_available():
            raise ModuleNotFoundError(
                "the Llama model of the experiments needs transformers; install it with "
                "pip install 'amp8[hf]'"
            )
        import transformers

        self.spec = spec
        shape = dict(
            vocab_size=spec.vocab_size, hidden_size=spec.n_embd, intermediate_size=spec.intermediate,
            num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
            num_key_value_heads=spec.n_kv_head, max_position_embeddings=spec.block_size,
            tie_word_embeddings=spec.tie_head, attn_implementation="sdpa",
        )
        if spec.n_expert:
            config = transformers.MixtralConfig(
                num_local_experts=spec.n_expert, num_experts_per_tok=spec.expert_top_k, **shape
            )
            model_class = transformers.MixtralForCausalLM
        else:
            config, model_class = transformers.LlamaConfig(**shape), transformers.LlamaForCausalLM
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device="cpu"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lm = model_class(config)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for byte ids ``idx`` (B, T), and the mean cross-entropy
        against ``targets`` (B, T) when given (-100 marks a target to ignore)."""
        logits = self.lm(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss
