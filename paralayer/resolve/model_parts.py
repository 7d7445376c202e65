"""The parts of a layer the resolver counts, one function per part and attention kind: widths,
parameters, the attention core's FLOPs (windows included), and where MoE layers and the MTP
blocks sit. Memory, cost, the split and the planner read these; a new attention kind is one
branch of :func:`attention_kind` and one entry in each ``_ATTN_*`` table below.

Why here and not in each formula: the same widths feed parameters, FLOPs, activations and the
cp ring's bytes; one place keeps them equal (issues #33, #34). Kinds:

    gqa  q, k, v, o of width n_heads·head_dim / n_kv_heads·head_dim (head_dim may differ from
         d_model/n_heads, Qwen3); qk_norm adds an RMSNorm gain of head_dim on q and one on k
         (replicated over tp)
    mla  DeepSeek-V2/V3 latent attention: q = q_b(norm(q_a(x))) (or one q projection when
         q_lora_rank is null), [c_kv; k_pe] = kv_a(x), [k_nope; v] = kv_b(norm(c_kv)), o; per
         head qk width nope+rope, v width v_head_dim. Under tp the heads split (q_b or q, kv_b,
         o); the down-projections q_a, kv_a and their norms are replicated (their outputs are
         shared by every head)
    linear  Gated DeltaNet (model/linear/, the layers model.layer_types marks "linear"): in_proj_qkvz
         h·(2·hk·dk + 2·hv·dv), in_proj_ba h·2hv, out_proj hv·dv·h; besides the matmuls the conv
         (channels 2·hk·dk + hv·dv, kernel K), dt_bias and A_log (hv each) and the gated norm's gain
         dv. Its core is the chunked delta rule (:func:`linear_core_fwd_flops`), not attention.
    model.attn_gate (Qwen3-Next's full layers) widens wq to 2·n_heads·hd (q and its gate).

Imports no torch.
"""
from __future__ import annotations

from paralayer.config import Config


# ------------------------------------------------------------------ attention widths
def attention_kind(cfg: Config) -> str:
    """'mla' when model.mla.kv_lora_rank > 0, else 'gqa' (plain, or with head_dim and qk_norm)."""
    return "mla" if cfg.model.mla.kv_lora_rank > 0 else "gqa"


def head_dim(cfg: Config) -> int:
    """GQA's per-head width: model.head_dim, or d_model // n_heads when it is null."""
    m = cfg.model
    return m.head_dim if m.head_dim else m.d_model // m.n_heads


def qk_head_dim(cfg: Config) -> int:
    """Per-head width of q and k (the scores' contraction)."""
    a = cfg.model.mla
    return a.qk_nope_head_dim + a.qk_rope_head_dim if attention_kind(cfg) == "mla" else head_dim(cfg)


def v_head_dim(cfg: Config) -> int:
    a = cfg.model.mla
    return a.v_head_dim if attention_kind(cfg) == "mla" else head_dim(cfg)


def rope_dim(cfg: Config) -> int:
    """Width RoPE rotates per head (its cos/sin tables): the decoupled key under MLA."""
    return cfg.model.mla.qk_rope_head_dim if attention_kind(cfg) == "mla" else head_dim(cfg)


def kv_heads(cfg: Config) -> int:
    """Heads of the K/V the attention core (and the cp ring) sees: MLA expands one per head."""
    m = cfg.model
    return m.n_heads if attention_kind(cfg) == "mla" else m.n_kv_heads


# ------------------------------------------------------------------ attention parameters
def _gqa_weights(cfg: Config) -> tuple[int, int]:
    m = cfg.model
    hd = head_dim(cfg)
    gate = m.n_heads if m.attn_gate else 0  # q_proj makes [q | gate] per head
    return m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads + gate), 0


def _mla_weights(cfg: Config) -> tuple[int, int]:
    m, a = cfg.model, cfg.model.mla
    h, n = m.d_model, m.n_heads
    dqk = a.qk_nope_head_dim + a.qk_rope_head_dim
    if a.q_lora_rank:
        split, rep = a.q_lora_rank * n * dqk, h * a.q_lora_rank
    else:
        split, rep = h * n * dqk, 0
    split += a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) + n * a.v_head_dim * h
    rep += h * (a.kv_lora_rank + a.qk_rope_head_dim)
    return split, rep


def _gqa_norms(cfg: Config) -> int:
    return 2 * head_dim(cfg) if cfg.model.qk_norm else 0


def _mla_norms(cfg: Config) -> int:
    a = cfg.model.mla
    return (a.q_lora_rank or 0) + a.kv_lora_rank


_ATTN_WEIGHTS = {"gqa": _gqa_weights, "mla": _mla_weights}
_ATTN_NORMS = {"gqa": _gqa_norms, "mla": _mla_norms}


def attn_weights(cfg: Config) -> tuple[int, int]:
    """(matmul weights split over tp, matmul weights replicated over tp) of one attention block."""
    return _ATTN_WEIGHTS[attention_kind(cfg)](cfg)


def attn_norm_params(cfg: Config) -> int:
    """Norm gains inside the attention (qk_norm's two head_dim gains; MLA's latent norms),
    replicated over tp; the layer's own two norms are counted by the layer."""
    return _ATTN_NORMS[attention_kind(cfg)](cfg)


def attn_matmul_params(cfg: Config) -> int:
    """Matmul weights of one attention block (the N of 6·N)."""
    split, rep = attn_weights(cfg)
    return split + rep


def attn_bias_params(cfg: Config) -> tuple[int, int]:
    """GPT-OSS's attention extras: (split over tp with the heads: the q, k, v biases and the sinks,
    replicated: the o bias); (0, 0) without model.attn_bias / model.attn_sinks."""
    m = cfg.model
    split = (m.n_heads + 2 * m.n_kv_heads) * head_dim(cfg) if m.attn_bias else 0
    return split + (m.n_heads if m.attn_sinks else 0), m.d_model if m.attn_bias else 0


def attn_extra_params(cfg: Config) -> int:
    """The attention's parameters outside its matmul weights: norms, biases, sinks."""
    split, rep = attn_bias_params(cfg)
    return attn_norm_params(cfg) + split + rep


def attn_rank_params(cfg: Config, tp: int) -> float:
    """One attention block's parameters on one tp rank: the split weights /tp, the rest whole."""
    split, rep = attn_weights(cfg)
    b_split, b_rep = attn_bias_params(cfg)
    return split / tp + rep + attn_norm_params(cfg) + b_split / tp + b_rep


# ------------------------------------------------------------------ the experts' extras (GPT-OSS)
def router_bias_params(cfg: Config) -> int:
    """model.moe.router_bias: one logit bias per expert (replicated, as the router)."""
    mo = cfg.model.moe
    return mo.num_experts if mo.router_bias else 0


def expert_bias_params(cfg: Config) -> int:
    """model.moe.expert_bias: one expert's gate, up and down biases (2·f_E + h), split over ep."""
    m = cfg.model
    return 2 * (m.moe.ffn_hidden or m.ffn_hidden) + m.d_model if m.moe.expert_bias else 0


# ------------------------------------------------------------------ linear attention (Gated DeltaNet)
def is_linear_layer(cfg: Config, i: int) -> bool:
    """Layer i is a Gated DeltaNet layer (model.layer_types "linear"; MTP blocks never are)."""
    lt = cfg.model.layer_types
    return lt is not None and i < len(lt) and lt[i] == "linear"


def linear_weights(cfg: Config) -> int:
    """Matmul weights of one Gated DeltaNet layer (all split by heads under tp)."""
    m, li = cfg.model, cfg.model.linear
    h, hk, hv = m.d_model, li.k_heads, li.v_heads
    return h * (2 * hk * li.head_k_dim + 2 * hv * li.head_v_dim) + h * 2 * hv + hv * li.head_v_dim * h


def linear_other_params(cfg: Config) -> int:
    """Its parameters outside the matmuls: the depthwise conv, dt_bias, A_log, the gated norm's gain."""
    li = cfg.model.linear
    channels = 2 * li.k_heads * li.head_k_dim + li.v_heads * li.head_v_dim
    return channels * li.conv_kernel + 2 * li.v_heads + li.head_v_dim


def layer_attn_matmul_params(cfg: Config, i: int) -> int:
    """Layer i's attention matmul weights: the linear layer's, or the attention block's."""
    return linear_weights(cfg) if is_linear_layer(cfg, i) else attn_matmul_params(cfg)


def linear_rank_params(cfg: Config, tp: int) -> float:
    """One linear layer's parameters on one tp rank: the matmuls, dt_bias and A_log split by heads;
    the conv weight and the gated norm's gain replicated (parallel/tensor/layout.py)."""
    hv = cfg.model.linear.v_heads
    return linear_weights(cfg) / tp + 2 * hv / tp + linear_other_params(cfg) - 2 * hv


def layer_attn_rank_params(cfg: Config, i: int, tp: int) -> float:
    """Layer i's attention (or linear layer) parameters on one tp rank."""
    return linear_rank_params(cfg, tp) if is_linear_layer(cfg, i) else attn_rank_params(cfg, tp)


def linear_core_fwd_flops(cfg: Config, piece: float | None = None) -> float:
    """Forward FLOPs per token of one linear layer's core: per value head and chunk of C tokens
    (model/linear/delta_rule.py) k_beta·kᵀ and q·kᵀ (2C²dk each), the two triangular solves (C²dv,
    C²dk), the state read twice and written once (2C·dk·dv each), attn·v_new (2C²dv): per token
    C(5dk + 3dv) + 6dk·dv, over the padded chunks (of the sequence, or of each ``piece`` of that
    many tokens run alone: cp's zigzag halves); plus the depthwise conv, 2K per channel."""
    m, li = cfg.model, cfg.model.linear
    s, c, dk, dv = piece or m.seq_len, li.chunk, li.head_k_dim, li.head_v_dim
    padded = -(-s // c) * c
    rule = li.v_heads * (c * (5 * dk + 3 * dv) + 6 * dk * dv) * padded / s
    return rule + 2.0 * li.conv_kernel * (2 * li.k_heads * dk + li.v_heads * dv)


def layer_core_fwd_flops(cfg: Config, i: int) -> float:
    """Forward FLOPs per token of layer i's core: the delta rule, or attention over its keys."""
    return linear_core_fwd_flops(cfg) if is_linear_layer(cfg, i) else core_fwd_flops_per_key(cfg) * core_keys(cfg, i)


def shared_gate_params(cfg: Config) -> int:
    """model.moe.shared_gate (Qwen3-Next): the shared expert's d_model → 1 gate, per MoE layer."""
    mo = cfg.model.moe
    return cfg.model.d_model if mo.shared_gate and mo.shared_ffn_hidden else 0


# ------------------------------------------------------------------ the layer's own norms
def layer_norm_count(cfg: Config) -> int:
    """RMSNorms of a layer on the residual stream: before attention and before the MLP, and with
    model.post_norms (Gemma 3) after each too: 4. Each has a gain of d_model, replicated over tp."""
    return 4 if cfg.model.post_norms else 2


def layer_norm_params(cfg: Config) -> int:
    return layer_norm_count(cfg) * cfg.model.d_model


# ------------------------------------------------------------------ windows and the core
def layer_window(cfg: Config, i: int) -> int | None:
    """Layer i's window (tokens a query sees, itself included) or None for full attention:
    model.layer_types when given, else every full_attention_every-th layer full (0: all sliding)."""
    m = cfg.model
    w = m.sliding_window
    if w is None:
        return None
    if m.layer_types is not None:
        return w if m.layer_types[i] == "sliding" else None
    k = m.full_attention_every
    return None if (k and (i + 1) % k == 0) else w


def mean_keys(s: int, window: int | None) -> float:
    """Exact mean keys a causal query attends over a sequence of s: (s+1)/2 for full attention;
    the mean of min(W, i+1) over i < s for a window W, = (W(W+1)/2 + (s−W)·W)/s when W < s."""
    if window is None or window >= s:
        return (s + 1) / 2
    return (window * (window + 1) / 2 + (s - window) * window) / s


def core_keys(cfg: Config, i: int) -> float:
    """Keys per query the model-FLOPs convention counts for layer i: s for full attention (the
    PaLM/torchtitan convention the plans have always used: the causal mask not halved), and a
    window's exact share of that, s · mean_keys(s, W) / mean_keys(s, s): equal to s when W ≥ s,
    and the window's real work otherwise (never a windowed layer counted as full: torchtitan #4300)."""
    s = cfg.model.seq_len
    w = layer_window(cfg, i)
    if w is None or w >= s:
        return float(s)
    return s * mean_keys(s, w) / mean_keys(s, None)


def core_fwd_flops_per_key(cfg: Config) -> float:
    """Forward FLOPs of the attention core per token per key: q·k (2·n_heads·d_qk) and the
    weighted sum of v (2·n_heads·d_v); 4·h for a plain block."""
    m = cfg.model
    return 2.0 * m.n_heads * (qk_head_dim(cfg) + v_head_dim(cfg))


# ------------------------------------------------------------------ layer placement
def is_moe_layer(cfg: Config, i: int) -> bool:
    """Layer i is MoE: experts on, past the first_k_dense dense layers, and (i+1) % every == 0
    (the rule paralayer/model's block applies; the MTP blocks count as layers n_layers…)."""
    mo = cfg.model.moe
    return mo.num_experts > 0 and i >= mo.first_k_dense and (i + 1) % mo.every == 0


def mtp_layers(cfg: Config) -> list[int]:
    """Layer indices of the MTP blocks: n_layers … n_layers+depth−1 (as DeepSeek-V3 numbers its
    MTP module layer 61); they sit on the last pipeline chunk."""
    m = cfg.model
    return list(range(m.n_layers, m.n_layers + m.mtp.depth))


def mtp_extra_params(cfg: Config) -> int:
    """Per MTP depth, besides its block: the norms of h and of the next token's embedding, the
    projection of their concatenation 2h → h, and the norm before the shared head."""
    h = cfg.model.d_model
    return 3 * h + 2 * h * h
