"""Mixtures of experts as the planner counts them: which of a block's parameters are
routed experts, and how many of them a token passes through.

A routed expert's parameters are those under a module named ``experts`` (Hugging Face's
Qwen-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, Llama 4, gpt-oss...: one fused tensor per
projection with the experts as its first dimension, or a ``ModuleList`` of them); shared
experts (``shared_expert``, ``shared_experts``) and the router are dense: every token
passes through them. A token passes through ``experts_per_token`` of ``experts``, so of a
block's routed matrices it multiplies that share; the rest of the block in full.

Every parameter is still trained and stepped, and its weights and optimizer state move
whole: a micro-batch of a few thousand tokens reaches every expert of a block (with 128
experts and 8 per token, each is missed by 4,096 tokens with odds (15/16)^4096); only
compute follows the active share.
"""
from __future__ import annotations

from dataclasses import dataclass

# The config fields that name the routed experts per block and how many a token takes.
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
PER_TOKEN_FIELDS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


@dataclass(frozen=True)
class Experts:
    """A model's routing: ``experts`` routed experts per mixture-of-experts block, of
    which each token takes ``per_token``."""
    experts: int
    per_token: int

    @property
    def share(self) -> float:
        """The share of a block's routed experts a token passes through."""
        return self.per_token / self.experts


def of_config(cfg: dict) -> Experts | None:
    """The routing a Hugging Face config describes, or None for a dense model."""
    experts = next((cfg[k] for k in EXPERT_FIELDS if isinstance(cfg.get(k), int) and cfg[k] > 1), None)
    per_token = next((cfg[k] for k in PER_TOKEN_FIELDS if isinstance(cfg.get(k), int) and cfg[k] > 0), None)
    if experts is None or per_token is None:
        return None
    return Experts(experts, min(per_token, experts))


def routed(name: str) -> bool:
    """Whether a parameter (its dotted name within a block) is a routed expert's."""
    return "experts" in name.split(".")


def active_matmul(block, experts: Experts | None) -> float:
    """The matrix parameters of ``block`` a token multiplies: all the dense ones and the
    routed experts' ``share``."""
    total = 0.0
    for name, p in block.named_parameters():
        if p.dim() < 2:
            continue
        total += p.numel() * (experts.share if experts is not None and routed(name) else 1.0)
    return total


def active(block, experts: Experts | None) -> float:
    """The parameters of ``block`` a token passes through (every vector, the active matrices)."""
    vectors = sum(p.numel() for p in block.parameters() if p.dim() < 2)
    if experts is not None:  # (an expert's bias is a routed vector: its share too)
        vectors -= sum(p.numel() * (1 - experts.share) for n, p in block.named_parameters() if p.dim() < 2 and routed(n))
    return vectors + active_matmul(block, experts)
