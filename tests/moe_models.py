"""Tiny mixture-of-experts modules with transformers' experts layout, for tests without
transformers: an experts module (3-D ``gate_up_proj`` and ``down_proj``, ``act_fn``,
``forward(hidden_states, top_k_index, top_k_weights)``, eager per-expert loop), a MoE
block with a Linear router and a small model around it."""

from __future__ import annotations

import torch
from torch import nn


class TinyExperts(nn.Module):
    """Experts as transformers 5 lays them out, computed expert by expert in float32."""

    def __init__(self, num_experts: int = 4, hidden: int = 32, intermediate: int = 16) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, intermediate) / intermediate**0.5)
        self.act_fn = nn.SiLU()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            tokens, slots = torch.where(top_k_index == expert)
            if tokens.numel() == 0:
                continue
            gate, up = nn.functional.linear(hidden_states[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out = out.index_add(0, tokens, y * top_k_weights[tokens, slots, None])
        return out


class TinyMoeBlock(nn.Module):
    """A Linear router (softmax over experts in float32, top-k, renormalized) and experts."""

    def __init__(self, num_experts: int = 16, hidden: int = 32, intermediate: int = 16, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = TinyExperts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x)


def tiny_moe_model(num_experts: int = 16, hidden: int = 32, seed: int = 0) -> nn.Sequential:
    """Linear, a MoE block and a Linear, built after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(hidden, hidden), TinyMoeBlock(num_experts, hidden), nn.Linear(hidden, hidden))


def routing(
    tokens: int, num_experts: int, top_k: int = 2, unused: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, top_k) expert indices (distinct per token, never one of ``unused``)
    and routing weights that sum to 1 per token."""
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    index = torch.stack([allowed[torch.randperm(len(allowed))[:top_k]] for _ in range(tokens)])
    return index, torch.softmax(torch.randn(tokens, top_k), dim=-1)
