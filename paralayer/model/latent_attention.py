"""Multi-head latent attention (DeepSeek-V2/V3 MLA), beside the plain attention of attention.py.

    q      = wq(x)                                 (q_lora_rank None)
           | q_b(RMSNorm(q_a(x)))                  (q_lora_rank r_q: a low-rank query)
             → per head [q_nope (nope) ; q_rot (rope)]
    c, k_r = kv_a(x) → [latent (kv_lora_rank) ; k_rot (rope)]   k_rot: ONE key part shared by all heads
    k, v   = kv_b(RMSNorm(c)) → per head [k_nope (nope) ; v (v_head_dim)]
    q_rot, k_rot get RoPE (the decoupled key); the nope parts get none
    out    = wo(softmax(q·k / τ) v),  q·k over nope+rope,  τ = sqrt(nope+rope) / mscale²

mscale = 0.1·mscale_all_dim·ln(factor) + 1 under YaRN (DeepSeek's yarn_get_mscale; 1 otherwise),
the softmax scale transformers' DeepseekV3Attention uses; cos/sin carry YaRN's own attention
factor (positions.py). RoPE here is rotate-half on the rope dims: DeepSeek's checkpoints lay them
out in interleaved pairs (``rope_interleave``), the same rotation after a fixed permutation of
q_rot's and k_rot's rows, which an importer applies to the weights (tests/test_latent_attention.py).

The plain causal core gets the softmax scale as SDPA's ``scale`` (as transformers passes it); a
replaced core (context parallel's ring) takes (q, k, v) with its own 1/sqrt(q width),
so q is multiplied by ``q_gain`` before it. Tensor and context parallel are not built for MLA
Under tensor parallel (parallel/tensor/layout.py ``_latent_plan``) the heads split; under context
parallel the ring carries K at nope+rope and V zero-padded to the same width (see ``_core``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.compat import aten_op
from paralayer.config import ModelConfig
from paralayer.model.attention import AttnFn, core_for, sdpa_causal
from paralayer.model.norms import RMSNorm
from paralayer.model.positions import apply_rope
from paralayer.model.recompute import rebuilt, recompute

#: the latent norms' eps: DeepSeek's code and transformers' DeepseekV3Attention build them with the
#: RMSNorm default 1e-6, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(nope + rope), times mscale² under YaRN with mscale_all_dim (DeepSeek-V3)."""
    m = cfg.mla
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    r = cfg.rope
    if r.type == "yarn" and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        for field, on in (("model.sliding_window", cfg.sliding_window is not None), ("model.qk_norm", cfg.qk_norm)):
            if on:  # parts of the plain attention MLA has no place for: refused, never dropped
                raise ValueError(f"{field} is not built with model.mla (latent attention)")
        d, heads = cfg.d_model, cfg.n_heads
        self.nope, self.rope, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        qk = self.nope + self.rope
        if m.q_lora_rank is None:
            self.wq = nn.Linear(d, heads * qk, bias=False)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.wq = None
            self.q_a = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b = nn.Linear(m.q_lora_rank, heads * qk, bias=False)
        self.kv_a = nn.Linear(d, self.rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_b = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, d, bias=False)
        # q is multiplied by this before the core, whose own scale is 1/sqrt(nope + rope)
        self.scale = softmax_scale(cfg)
        self.q_gain = self.scale * math.sqrt(qk)
        self.window = None
        self.attn_fn: AttnFn = core_for(None)
        self.recompute_core = False
        self.recompute_up = False  # recompute=norm_up: the latent norms and up-projections (_forward_up)
        self.max_logit = None  # QK-clip on: a paralayer.model.max_logit.MaxLogit of this rank's heads
        #: run the memory-efficient fused kernel's op whatever the device: the rehearsal of a GPU
        #: layout sets it (rehearse/rank.py), where SDPA would pick it, because on CPU the
        #: differing q/k and v widths send SDPA to its math path, which saves the score matrix
        #: (128 heads x 4096 keys per token at DeepSeek-V3's size) that no GPU kernel keeps
        self.fused_kernel = False
        self.tp_overlap = None
        self.tp_mesh = None  # set by parallel/tensor/layout.py (MLA under tp: the replicated down-projections)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        if self.recompute_up:
            return self._forward_up(x, cos, sin)
        q = self.wq(x) if self.wq is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        latent, k_rot = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        if self.tp_mesh is not None:  # the shared rope key: each rank's heads give part of its grad
            from torch.distributed.tensor import Partial

            k_rot = k_rot.to_local(grad_placements=[Partial()])
        k_rot = k_rot.view(b, 1, s, self.rope)
        if self.recompute_core:
            out = recompute(self._core, q, k_nope, k_rot, v, cos, sin)
        else:
            out = self._core(q, k_nope, k_rot, v, cos, sin)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _forward_up(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """recompute=norm_up (DeepSeek-V3 §3.2.3): the latent norms, the up-projections q_b and
        kv_b, and RoPE and the concatenation that turn their outputs into the core's q, k, v run
        as one :func:`rebuilt` region; the core saves handles for q, k, v, and backward makes them
        again from what stays: the latents c_q and c_kv and the rope key (q_lora_rank null: wq's
        output, which is no up-projection, stays in place of c_q)."""
        b, s = x.shape[:2]
        q_src = self.wq(x) if self.wq is not None else self.q_a(x)
        latent, k_rot = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        (q, k, v), consumers = rebuilt(self._up, q_src, latent, k_rot, cos, sin)
        with consumers:
            out = self._attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _up(self, q_src, latent, k_rot, cos, sin):
        b, s = latent.shape[:2]
        q = self.q_b(self.q_a_norm(q_src)) if self.wq is None else q_src
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        kv = self.kv_b(self.kv_a_norm(latent)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return self._qkv(q, k_nope, k_rot.view(b, 1, s, self.rope), v, cos, sin)

    def _core(self, q, k_nope, k_rot, v, cos, sin):
        return self._attend(*self._qkv(q, k_nope, k_rot, v, cos, sin))

    def _qkv(self, q, k_nope, k_rot, v, cos, sin):
        """The core's q, k, v: RoPE on the rope parts, the nope and rope parts joined."""
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin)], dim=-1)
        k_rot = apply_rope(k_rot, cos, sin).expand(-1, k_nope.shape[1], -1, -1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        if self.max_logit is not None:
            self.max_logit.record(q, k, self.scale)
        if self.attn_fn is sdpa_causal and self.fused_kernel:
            # as CUDA's autocast casts SDPA's inputs before its kernel (the aten op has no autocast
            # rule of its own on CPU, where the rehearsal runs it: it would keep fp32 q and k)
            dev = q.device.type
            if torch.is_autocast_enabled(dev):
                dt = torch.get_autocast_dtype(dev)
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
        return q, k, v

    def _attend(self, q, k, v):
        if self.attn_fn is sdpa_causal and self.fused_kernel:
            return aten_op("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, True,
                                                                     scale=self.scale)[0]
        if self.attn_fn is sdpa_causal:  # the scale given to the kernel, as transformers does
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        # A replaced core (context parallel's ring) carries K at nope+rope and V at v_head_dim; its
        # CPU flash kernel, which wants one head width, pads V per block after the ring
        # (parallel/context/ring.py _block_fwd)
        if v.shape[-1] > q.shape[-1]:
            raise ValueError("model.mla.v_head_dim > qk_nope_head_dim + qk_rope_head_dim is not built under cp")
        if self.fused_kernel:  # the rehearsal of a GPU layout: the ring's blocks as a GPU runs them
            return self.attn_fn(q * self.q_gain, k, v.contiguous(), backend="cuda")
        return self.attn_fn(q * self.q_gain, k, v.contiguous())
