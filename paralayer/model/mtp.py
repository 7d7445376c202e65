"""Multi-token prediction (DeepSeek-V3 report §2.2): D extra depths after the main model, on the
last pipeline stage, sharing the embedding and the output head.

For depth k = 1 … D and position i (0-based, tokens t_0 … t_{s-1}, labels l_i = t_{i+1}):

    h^0        = the main model's final-norm output (what the head reads)
    h'^k_i     = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]   M_k = eh_proj, (d, 2d)
    h^k        = RMSNorm_k(TRM_k(h'^k))                             TRM_k: one block of the model
    CE_k       = mean_i CE(Head(h^k_i), t_{i+k+1})                  over the i with i+k+1 < s
    L_MTP      = λ / D · Σ_k CE_k

The embedding comes first in the concatenation, as in DeepSeek's released weights (and
Megatron's and vLLM's code that load them): the report writes [h; Emb], a column order of M_k.
RMSNorm_k is the checkpoint's ``shared_head.norm``; h^k feeds depth k+1 after it (Megatron).
t_{i+k} = l_{i+k-1}: everything a depth needs is in the labels, which the last stage holds, so the
MTP runs in the loss (:func:`mtp_objective`), not in the stage's forward. The sequence keeps its
length s: the rolled-in tail positions (no token to read) take id 0 and have no target; causal
attention keeps them from touching the positions before them.

Under pp > 1 the last stage holds its own copy of the embedding (``embed``), drawn from the same
(seed, name) and given the sum of both copies' gradients each step, as tied embeddings are
(paralayer/parallel/tied_embeddings.py). With pp = 1 the model's own embedding is used.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from paralayer.config import ModelConfig
from paralayer.model.block import TransformerBlock
from paralayer.model.norms import RMSNorm


class MTPLayer(nn.Module):
    """One depth: the two norms, the projection M_k, its block and its head norm."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        d = cfg.d_model
        self.enorm = RMSNorm(d, eps=cfg.norm_eps)
        self.hnorm = RMSNorm(d, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = TransformerBlock(cfg, layer_id)
        self.norm = RMSNorm(d, eps=cfg.norm_eps)

    def forward(self, h: Tensor, e: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, cos, sin))


class MultiTokenPrediction(nn.Module):
    """The D depths (layer ids n_layers … n_layers+D−1, DeepSeek's checkpoint numbering)."""

    def __init__(self, cfg: ModelConfig, vocab_padded: int):
        super().__init__()
        self.depth = cfg.mtp.depth
        self.loss_weight = cfg.mtp.loss_weight
        self.register_module("embed", None)  # pp > 1: this stage's copy (see the module doc)
        self.layers = nn.ModuleDict({str(k): MTPLayer(cfg, cfg.n_layers + k) for k in range(self.depth)})
        self.vocab_padded = vocab_padded
        self.d_model = cfg.d_model
        # False while a forward must not feed the loss's MTP (a pipeline stage's first-step shape
        # inference on uninitialised tensors; runtime/moe_step.count_real_forwards_only toggles it)
        self.count_stats = True
        self.reset_step_stats()

    def add_embedding_copy(self) -> None:
        self.embed = nn.Embedding(self.vocab_padded, self.d_model,
                                  _weight=torch.empty(self.vocab_padded, self.d_model))

    def reset_step_stats(self) -> None:
        """``loss_sum``: Σ of L_MTP over this step's microbatches; ``forwards``: how many."""
        self.loss_sum = 0.0
        self.forwards = 0

    def forward(self, h0: Tensor, labels: Tensor, cos: Tensor, sin: Tensor, embedding: nn.Module,
                head: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """[(logits of depth k, its targets)] for k = 1 … D; ``labels`` (b, s) with −100 at the end."""
        out = []
        h = h0
        anchor = _zero_anchor(h0) if self.embed is not None else None
        for k, layer in enumerate(self.layers.values(), start=1):
            ids = _shift(labels, k - 1).clamp(min=0)  # t_{i+k}; the tail (no token) reads id 0
            e = embedding(ids)
            h = layer(h, e if anchor is None else e + anchor, cos, sin)
            out.append((head(h), _shift(labels, k)))  # targets t_{i+k+1}, −100 past the end
        return out


def _zero_anchor(h0: Tensor) -> Tensor:
    """0·Σh0: adds exactly nothing, but ties each depth's embedding to the stage input in the
    autograd graph. The split backward of the V schedules (torch.distributed.pipelining, weight
    pass) starts a parameter's gradient from where its path first meets the input's; without
    this, the embedding copy's path meets it at every depth, and the pass from depth 2 walks back
    through depth 1's block, freeing it before that block's own weight pass (seen: D=2 under
    dualpipev, "backward through the graph a second time")."""
    local = h0.to_local() if hasattr(h0, "to_local") else h0
    return local.sum() * 0.0


def _shift(labels: Tensor, k: int) -> Tensor:
    """labels moved k places left along the sequence, −100 filling the last k."""
    if k == 0:
        return labels
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], k), -100)], dim=1)


def moe_blocks(mtp: Optional[MultiTokenPrediction]) -> list[nn.Module]:
    """The MTP depths' MoE feed-forwards (their aux losses and routing stats count too)."""
    if mtp is None:
        return []
    return [layer.block.feed_forward for layer in mtp.layers.values() if layer.block.is_moe]
