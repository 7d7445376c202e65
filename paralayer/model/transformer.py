"""The plain Llama-style decoder every layout starts from.

Built on the meta device, split and sharded by ``paralayer.parallel``, then materialised by
:func:`init_weights`, which draws each parameter's FULL tensor from (seed, parameter name) and
keeps the local slice: one seed gives the same full weights under any layout. Names follow the
Hugging Face Llama layout closely enough for a direct mapping (``paralayer.checkpoint.hf``); RoPE uses the
same rotate-half convention so imported weights need no permutation.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paralayer.config import ModelConfig

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (b, heads, s, d); GQA by repeating K/V heads to the query heads."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin for the given positions (s,) or (b, s): rotate-half layout, shape (..., s, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, d); cos/sin: (s, d) or (b, s, d)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) · w, computed in fp32; saves x (in its own dtype) and the per-token 1/rms."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd  # recomputed: one elementwise pass instead of a saved fp32 copy
        gf = g.float()
        gw = (gf * xhat).sum(dim=tuple(range(g.dim() - 1))).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gy = gf * weight.float()
            gx = (rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that keeps less for backward: its input and the per-token 1/rms, not the
    fp32 copy of the input and the fp32 normalised input torch's composite keeps (4h + 2 bytes
    per token in bf16, 8h + 4 in fp32, where this keeps 2h + 4 and 4h + 4). What Megatron's and
    Apex's fused norms save; same parameter, same result (tests/test_recompute.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFn.apply(x, self.weight, eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        # Replaced by ring attention under context parallel; wrapped by selective recompute.
        self.attn_fn: AttnFn = sdpa_causal
        self.recompute_core = False
        # parallel.tp_overlap: the tp collectives fused into the GEMMs (parallel/tp_overlap.py)
        self.tp_overlap = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap is not None:  # x: this rank's s/tp tokens; q, k, v: the whole sequence
            q, k, v = self.tp_overlap.gather_matmul(x, (self.wq.weight, self.wk.weight, self.wv.weight))
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]
        # -1 heads: under tensor parallel each rank holds n_heads/tp of them.
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.recompute_core:
            out = checkpoint(self._core, q, k, v, cos, sin, use_reentrant=False)
        else:
            out = self._core(q, k, v, cos, sin)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if self.tp_overlap is not None:
            return self.tp_overlap.matmul_scatter(out, self.wo.weight)
        return self.wo(out)

    def _core(self, q, k, v, cos, sin):
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        return self.attn_fn(q, k, v)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.recompute_act = False
        self.tp_overlap = None  # as Attention.tp_overlap
        self.act_fn = _swiglu  # compiled in place under train.compile with tp (model/compile.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap is not None:
            gate, up = self.tp_overlap.gather_matmul(x, (self.w1.weight, self.w3.weight))
        else:
            gate, up = self.w1(x), self.w3(x)
        if self.recompute_act:
            act = checkpoint(self.act_fn, gate, up, use_reentrant=False)
        else:
            act = self.act_fn(gate, up)
        if self.tp_overlap is not None:
            return self.tp_overlap.matmul_scatter(act, self.w2.weight)
        return self.w2(act)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Layers 0 … first_k_dense−1 stay dense (DeepSeek-V3's first_k_dense_replace); of the rest,
    every ``every``-th (1-based, Qwen3-MoE's decoder_sparse_step) is MoE."""
    m = cfg.moe
    return m.num_experts > 0 and layer_id >= m.first_k_dense and (layer_id + 1) % m.every == 0


def router_spec(cfg: ModelConfig):
    """The router of ``model.moe`` (paralayer/model/routing.py)."""
    from paralayer.model.routing import RouterSpec

    m = cfg.moe
    return RouterSpec(kind=m.router, top_k=m.top_k, n_group=m.n_group, topk_group=m.topk_group,
                      routed_scaling_factor=m.routed_scaling_factor, norm_topk_prob=m.norm_topk_prob)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.is_moe = is_moe_layer(cfg, layer_id)
        if self.is_moe:
            from paralayer.model.moe import MoEFeedForward

            m = cfg.moe
            self.feed_forward = MoEFeedForward(
                cfg.d_model, m.ffn_hidden or cfg.ffn_hidden, m.num_experts, m.top_k, m.capacity_factor,
                router=m.router, shared_ffn_hidden=m.shared_ffn_hidden, spec=router_spec(cfg),
                seq_aux=m.seq_aux_loss_coef > 0)
        else:
            self.feed_forward = FeedForward(cfg.d_model, cfg.ffn_hidden)
        self.recompute_full = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute_full:
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocab rounded up to a multiple of tp (the padding rows never count in the loss)."""
    return int(math.ceil(vocab_size / tp) * tp)


class Transformer(nn.Module):
    """Decoder-only LM. A pipeline stage is the same class with some parts set to None."""

    def __init__(self, cfg: ModelConfig, vocab_padded: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.vocab_padded = vocab_padded or cfg.vocab_size
        # An explicit (uninitialised) weight skips nn.Embedding's normal_ init: on the meta device
        # that init pulls in torch._dynamo (~2 s per rank), and init_weights overwrites it anyway.
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(
            self.vocab_padded, cfg.d_model, _weight=torch.empty(self.vocab_padded, cfg.d_model))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: Optional[nn.RMSNorm] = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(cfg.d_model, self.vocab_padded, bias=False)
        self.head_dim = cfg.d_model // cfg.n_heads
        # Global positions of the local tokens (set under context parallel: zigzag chunks).
        self.positions: Optional[torch.Tensor] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) on the first stage, hidden (b, s, d) elsewhere → logits or hidden."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        s = h.shape[1]
        pos = self.positions.to(h.device) if self.positions is not None else torch.arange(s, device=h.device)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.cfg.rope_theta, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the MoE layers' load-balancing losses from the last forward (None if dense)."""
        total = None
        for layer in self.layers.values():
            ff = layer.feed_forward
            a = getattr(ff, "aux_loss", None)
            if a is not None:
                total = a if total is None else total + a
        return total

    def seq_aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the MoE layers' sequence-wise balance losses (None when off or dense)."""
        total = None
        for layer in self.layers.values():
            a = getattr(layer.feed_forward, "seq_aux_loss", None)
            if a is not None:
                total = a if total is None else total + a
        return total


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; padded vocab columns are masked out."""
    logits = logits.float()
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


# ------------------------------------------------------------------ layout-independent init
def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_init(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter, from its name alone."""
    if cfg.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # one matrix, two copies (paralayer/parallel/tied_embeddings.py)
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    std = cfg.init_std
    if parent in ("wo", "w2") or leaf == "w2":
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    if parent in ("tok_embeddings",) and not cfg.tie_embeddings:
        std = 1.0  # tied, it is also the head: init_std like Megatron's shared embedding
    return torch.empty(shape).normal_(0.0, std, generator=g)


def _logical_shape(model: Transformer, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name.startswith("tok_embeddings.") or name.startswith("output."):
        return (model.vocab_size,) + tuple(shape[1:])
    return shape


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> None:
    """Materialise every parameter: full tensor from (seed, name), then this rank's slice.

    Works for plain tensors, DTensors (TP / FSDP shards, sliced locally without communication)
    and modules that hold a slice of a dimension (``local_slices``: experts under EP).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    root = model
    vocab = getattr(model, "vocab_size", cfg.vocab_size)
    owners = {}
    for mod_name, mod in model.named_modules():
        for p_name in getattr(mod, "local_slices", {}) or {}:
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = (mod, p_name)
    for name, param in model.named_parameters():
        clean = _clean_name(name)
        global_shape = tuple(param.shape)  # DTensor .shape is the global shape
        if clean in owners:
            mod, p_name = owners[clean]
            dim, offset, full_len = mod.local_slices[p_name]
            shp = list(global_shape)
            shp[dim] = full_len
            global_shape = tuple(shp)
        logical = list(global_shape)
        if clean.startswith("tok_embeddings.") or clean.startswith("output."):
            logical[0] = vocab
        full = full_init(clean, tuple(logical), cfg, seed)
        if tuple(logical) != global_shape and clean not in owners:
            pad = torch.zeros(global_shape)
            pad[: logical[0]] = full
            full = pad
        if clean in owners:
            mod, p_name = owners[clean]
            dim, offset, _ = mod.local_slices[p_name]
            local_len = param.shape[dim]  # a DTensor's shape is this ep rank's expert count
            full = full.narrow(dim, offset, local_len).contiguous()
        full = full.to(device=device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    del root


def _clean_name(name: str) -> str:
    """Parameter name without wrapper prefixes (checkpoint, compile, FSDP)."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


def count_matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (embedding lookup excluded)."""
    h, f = cfg.d_model, cfg.ffn_hidden
    hd = h // cfg.n_heads
    attn = h * hd * (cfg.n_heads * 2 + cfg.n_kv_heads * 2)
    dense_mlp = 3 * h * f
    total = 0
    for i in range(cfg.n_layers):
        total += attn
        if is_moe_layer(cfg, i):
            m = cfg.moe
            total += m.top_k * 3 * h * (m.ffn_hidden or f) + h * m.num_experts + 3 * h * m.shared_ffn_hidden
        else:
            total += dense_mlp
    return total + h * cfg.vocab_size
