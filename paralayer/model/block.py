"""One decoder block, assembled from the config: pre-norm attention (plain or windowed, by the
layer pattern of paralayer/config/layer_pattern.py; Gated DeltaNet on its "linear" layers),
pre-norm SwiGLU / GeGLU or MoE feed-forward.
With ``model.post_norms`` (Gemma 3) the attention's and the feed-forward's outputs are normed too
before they join the residual: x + post_attention_norm(attn(attention_norm(x))), then the same
with ffn_norm / post_ffn_norm; the norms are Gemma's (1 + w) under ``model.norm_offset``."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from paralayer.config import ModelConfig
from paralayer.config.layer_pattern import layer_types, layer_window
from paralayer.model.attention import Attention
from paralayer.model.mlp import FeedForward
from paralayer.model.norms import make_norm
from paralayer.model.recompute import rebuilt, recompute


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Layers 0 … first_k_dense−1 stay dense (DeepSeek-V3's first_k_dense_replace); of the rest,
    every ``every``-th (1-based, Qwen3-MoE's decoder_sparse_step) is MoE."""
    m = cfg.moe
    return m.num_experts > 0 and layer_id >= m.first_k_dense and (layer_id + 1) % m.every == 0


def is_linear_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Layer ``layer_id`` is a Gated DeltaNet layer (model.layer_types "linear"; MTP depths are not)."""
    types = layer_types(cfg)
    return layer_id < len(types) and types[layer_id] == "linear"


def router_spec(cfg: ModelConfig):
    """The router of ``model.moe`` (paralayer/model/routing.py)."""
    from paralayer.model.routing import RouterSpec

    m = cfg.moe
    return RouterSpec(kind=m.router, top_k=m.top_k, n_group=m.n_group, topk_group=m.topk_group,
                      routed_scaling_factor=m.routed_scaling_factor, norm_topk_prob=m.norm_topk_prob)


def _feed_forward(cfg: ModelConfig, layer_id: int) -> nn.Module:
    if not is_moe_layer(cfg, layer_id):
        return FeedForward(cfg.d_model, cfg.ffn_hidden, cfg.mlp_act)
    from paralayer.model.moe import MoEFeedForward

    m = cfg.moe
    return MoEFeedForward(cfg.d_model, m.ffn_hidden or cfg.ffn_hidden, m.num_experts, m.top_k, m.capacity_factor,
                          router=m.router, shared_ffn_hidden=m.shared_ffn_hidden, spec=router_spec(cfg),
                          seq_aux=m.seq_aux_loss_coef > 0, router_bias=m.router_bias, expert_bias=m.expert_bias,
                          swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha, shared_gate=m.shared_gate)


def _attention(cfg: ModelConfig, layer_id: int) -> nn.Module:
    if is_linear_layer(cfg, layer_id):  # Gated DeltaNet (Qwen3-Next)
        from paralayer.model.linear.gated_deltanet import GatedDeltaNet

        li = cfg.linear
        return GatedDeltaNet(cfg.d_model, li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim, li.conv_kernel,
                             li.chunk, cfg.norm_eps)
    if cfg.mla.kv_lora_rank > 0:  # multi-head latent attention (DeepSeek-V3)
        from paralayer.model.latent_attention import LatentAttention

        return LatentAttention(cfg)
    return Attention(cfg, window=layer_window(cfg, layer_id))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = make_norm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.attention = _attention(cfg, layer_id)
        self.ffn_norm = make_norm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        post = cfg.post_norms
        self.post_attention_norm = make_norm(cfg.d_model, cfg.norm_eps, cfg.norm_offset) if post else None
        self.post_ffn_norm = make_norm(cfg.d_model, cfg.norm_eps, cfg.norm_offset) if post else None
        self.is_moe = is_moe_layer(cfg, layer_id)
        self.feed_forward = _feed_forward(cfg, layer_id)
        self.recompute_full = False
        #: recompute=norm_up: the block's norms rebuilt in backward (model/recompute.py rebuilt):
        #: only their inputs stay, not their outputs, which the next GEMMs would otherwise keep
        self.recompute_norms = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask``: the chunk's window mask (attention.window_bias) for a windowed layer."""
        if self.recompute_full:
            return recompute(self._forward, x, cos, sin, mask)
        return self._forward(x, cos, sin, mask)

    def _forward(self, x, cos, sin, mask=None):
        xn, consumers = self._norm(self.attention_norm, x)
        with consumers:
            # by keyword: tensor parallel's input plan for the attention names its three positional inputs
            a = self.attention(xn, cos, sin) if mask is None else self.attention(xn, cos, sin, mask=mask)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        hn, consumers = self._norm(self.ffn_norm, h)
        with consumers:
            f = self.feed_forward(hn)
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))

    def _norm(self, norm: nn.Module, x: torch.Tensor):
        """``(norm(x), the context its consumers run in)``: rebuilt in backward under norm_up."""
        if self.recompute_norms:
            return rebuilt(norm, x)
        return norm(x), contextlib.nullcontext()
