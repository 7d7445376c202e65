"""The MoE routers: which experts a token goes to, with what weight, and the balance losses.

    softmax (Mixtral, Qwen3-MoE): probs = softmax(logits); top-k of probs; weights = those probs,
        renormalised over the k when ``norm_topk_prob`` (Mixtral always, Qwen3-MoE per its config).
    sigmoid (DeepSeek-V3): scores = sigmoid(logits); selection on scores + expert_bias (the bias
        only selects: aux-loss-free balancing); with n_group > 1 the experts are cut into n_group
        equal groups, each group is scored by the SUM OF ITS BEST TWO selection scores, the
        topk_group best groups are kept and the top-k is taken inside them (node-limited routing:
        a group is a node's experts, so a token reaches at most topk_group nodes); weights = the
        chosen scores (no bias), renormalised when ``norm_topk_prob``, times
        ``routed_scaling_factor``.

The same code as transformers' DeepseekV3TopkRouter and Qwen3MoeTopKRouter (tests/test_routing.py
holds them to it). Every function here is per token, so a layout never changes a decision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class RouterSpec:
    """What a router needs from ``model.moe`` (one record, so the MoE block stays short)."""
    kind: str = "softmax"  # softmax | sigmoid
    top_k: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: Optional[bool] = None  # None = the router's habit (both renormalise)

    def check(self, num_experts: int) -> None:
        if self.kind not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.kind!r}")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {self.top_k}")
        if self.n_group < 1 or num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.n_group > 1 and self.kind != "sigmoid":
            raise ValueError("n_group > 1 (routing by group) is DeepSeek-V3's sigmoid router's: set router=sigmoid")
        if self.n_group > 1 and self.top_k > self.topk_group * (num_experts // self.n_group):
            raise ValueError(f"top_k={self.top_k} exceeds the experts of topk_group={self.topk_group} groups")

    @property
    def renormalise(self) -> bool:
        return True if self.norm_topk_prob is None else bool(self.norm_topk_prob)


def group_mask(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """(T, E) selection scores → (T, E) bool: the experts of each token's topk_group best groups,
    a group scored by the sum of its best two experts (DeepSeek-V3; one-expert groups: that one)."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    best = min(2, E // n_group)
    group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)  # (T, n_group)
    keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def route(logits: Tensor, spec: RouterSpec, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """logits (T, E) fp32 → (expert ids (T, k), weights (T, k), probs (T, E)). ``probs`` is what
    the balance losses average (softmax probs; sigmoid scores over their row sum, DeepSeek's s')."""
    if spec.kind == "softmax":
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(spec.top_k, dim=-1)
        if spec.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)
        choice = scores.detach() if bias is None else scores.detach() + bias
        if spec.n_group > 1:
            choice = choice.masked_fill(~group_mask(choice, spec.n_group, spec.topk_group), float("-inf"))
        experts = choice.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if spec.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return experts, weights, probs


def switch_loss(experts: Tensor, probs: Tensor) -> Tensor:
    """Switch load balancing over all the tokens given: E·Σ_i f_i·P_i, f_i the fraction of
    token-slots routed to expert i (no gradient), P_i the mean router prob of expert i."""
    T, E = probs.shape
    f = torch.bincount(experts.reshape(-1), minlength=E).float() / experts.numel()
    return E * (f * probs.mean(dim=0)).sum()


def sequence_loss(experts: Tensor, probs: Tensor, batch: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (report eq. 17–20), averaged over the sequences:
    per sequence of T tokens, f_i = N_r/(K_r·T)·Σ_t 1[i ∈ top-k of t], P_i = 1/T·Σ_t s'_{i,t},
    L = Σ_i f_i·P_i. ``experts`` (B·T, k) and ``probs`` (B·T, E) in sequence-major token order."""
    E, k = probs.shape[-1], experts.shape[-1]
    T = probs.shape[0] // batch
    hits = torch.zeros(batch, T * k, E, device=probs.device, dtype=probs.dtype)
    hits.scatter_(2, experts.reshape(batch, T * k, 1), 1.0)
    f = hits.sum(dim=1) * (E / (k * T))  # (B, E), no gradient: built from indices
    P = probs.reshape(batch, T, E).mean(dim=1)
    return (f * P).sum(dim=-1).mean()
