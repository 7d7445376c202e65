"""Checks of the model-family keys (head_dim, qk_norm, RoPE kinds, sliding windows, MLA, MTP,
DeepSeek-V3 routing): each bad value is a :class:`ConfigError` naming the field and what is valid.

Why a module of its own: these keys only make sense together (a window with its layer pattern,
MLA's widths, the groups of the router), and a value the model cannot run exactly must be refused
before anything is written, never approximated (issues #33, #34). The numeric upper bounds keep a
typo from turning the resolver's sums into a hang, as config/bounds.py does for the older keys.
Imports no torch.
"""
from __future__ import annotations

import math
from typing import Any

from paralayer.config.schema import LAYER_TYPES, LINEAR_PROJ, MLP_ACTS, ROPE_TYPES, Config, ConfigError

#: Upper bounds of the new integer keys (far beyond any published model: DeepSeek-V3's MLA ranks
#: 1536/512, head_dim 128..256, windows up to 128K, MTP depth 1).
MAX_HEAD_DIM = 2 ** 12
MAX_WINDOW = 2 ** 24
MAX_RANK = 2 ** 17
MAX_GROUPS = 2 ** 12
MAX_MTP_DEPTH = 16


def _int(field: str, value: Any, lo: int, hi: int, what: str, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        null = " or null" if nullable else ""
        raise ConfigError(field, f"must be an integer from {lo} to {hi:,}{null} ({what}), got {value!r}")


def _num(field: str, value: Any, lo: float, what: str, strict: bool = False, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or value < lo or (strict and value == lo):
        null = " or null" if nullable else ""
        raise ConfigError(field, f"must be a finite number {'>' if strict else '>='} {lo:g}{null} ({what}), "
                          f"got {value!r}")


def check_model_keys(cfg: Config) -> None:
    """Every family key in range and consistent with its siblings; the first problem raises."""
    _check_attention(cfg)
    _check_gemma(cfg)
    _check_gpt_oss(cfg)
    _check_rope(cfg)
    _check_window(cfg)
    _check_linear(cfg)
    _check_mla(cfg)
    _check_moe_routing(cfg)
    _check_mtp(cfg)


def _check_attention(cfg: Config) -> None:
    m = cfg.model
    hd = m.head_dim
    if hd is not None:
        if isinstance(hd, bool) or not isinstance(hd, int) or not 2 <= hd <= MAX_HEAD_DIM or hd % 2:
            raise ConfigError("model.head_dim", f"must be an even integer from 2 to {MAX_HEAD_DIM:,} (RoPE rotates "
                              f"pairs) or null (= model.d_model/model.n_heads), got {hd!r}")
    if not isinstance(m.qk_norm, bool):
        raise ConfigError("model.qk_norm", f"must be true or false, got {m.qk_norm!r}")


def _check_gemma(cfg: Config) -> None:
    """Gemma 3's parts: the switches, the GLU's activation, the attention scalar, the local RoPE base."""
    m = cfg.model
    for name in ("embed_scale", "norm_offset", "post_norms"):
        if not isinstance(getattr(m, name), bool):
            raise ConfigError(f"model.{name}", f"must be true or false, got {getattr(m, name)!r}")
    if m.mlp_act not in MLP_ACTS:
        raise ConfigError("model.mlp_act", f"'{m.mlp_act}' is not one of: {', '.join(MLP_ACTS)}")
    _num("model.query_pre_attn_scalar", m.query_pre_attn_scalar, 0.0, "softmax scale 1/sqrt(this); null = "
         "head_dim", strict=True, nullable=True)
    _num("model.rope_local_theta", m.rope_local_theta, 0.0, "the sliding layers' RoPE base; null = the full "
         "layers' RoPE", strict=True, nullable=True)
    if m.mlp_act != "silu" and m.moe.num_experts > 0:
        raise ConfigError("model.mlp_act", f"'{m.mlp_act}' is built for the dense MLP only; the experts run "
                          "SwiGLU: use silu with model.moe.num_experts > 0")
    if m.norm_offset and m.mtp.depth > 0:
        raise ConfigError("model.norm_offset", "true is not built with MTP (model.mtp.depth > 0: its norms are "
                          "DeepSeek's plain RMSNorm); use false or model.mtp.depth=0")
    if m.rope_local_theta is not None and m.mla.kv_lora_rank > 0:
        raise ConfigError("model.rope_local_theta", "does not apply with MLA (one RoPE for its shared key); use null")


def _check_gpt_oss(cfg: Config) -> None:
    """GPT-OSS's parts: attention biases and sinks (GQA only), the experts' biases and clamped SwiGLU."""
    m, mo = cfg.model, cfg.model.moe
    for name, v in (("attn_bias", m.attn_bias), ("attn_sinks", m.attn_sinks), ("moe.router_bias", mo.router_bias),
                    ("moe.expert_bias", mo.expert_bias)):
        if not isinstance(v, bool):
            raise ConfigError(f"model.{name}", f"must be true or false, got {v!r}")
    for name in ("attn_bias", "attn_sinks"):
        if getattr(m, name) and m.mla.kv_lora_rank > 0:
            raise ConfigError(f"model.{name}", "true is built for GQA attention only (not MLA); use false")
    _num("model.moe.swiglu_limit", mo.swiglu_limit, 0.0, "GPT-OSS's clamp of the experts' SwiGLU; null = none",
         strict=True, nullable=True)
    _num("model.moe.swiglu_alpha", mo.swiglu_alpha, 0.0, "the clamped SwiGLU's sigmoid gain", strict=True)
    if m.rope.truncate not in (True, False):
        raise ConfigError("model.rope.truncate", f"must be true or false, got {m.rope.truncate!r}")


def _check_rope(cfg: Config) -> None:
    r = cfg.model.rope
    if r.type not in ROPE_TYPES:
        raise ConfigError("model.rope.type", f"'{r.type}' is not one of: {', '.join(ROPE_TYPES)}")
    _num("model.rope.factor", r.factor, 1.0, "the context extension; 1 = none")
    if r.type == "default":
        if r.factor != 1:
            raise ConfigError("model.rope.factor", f"{r.factor:g} needs model.rope.type=linear, llama3 or yarn "
                              "(the plain RoPE of type default takes factor 1)")
        return
    if r.type == "linear":  # positions / factor: no other key
        return
    if r.original_max_position is None:
        raise ConfigError("model.rope.original_max_position", f"model.rope.type={r.type} needs the pre-training "
                          "context it extends (an integer from 1), got null")
    _int("model.rope.original_max_position", r.original_max_position, 1, 2 ** 24, "the pre-training context")
    if r.type == "llama3":
        _num("model.rope.low_freq_factor", r.low_freq_factor, 0.0, "llama3 smoothing", strict=True)
        _num("model.rope.high_freq_factor", r.high_freq_factor, 0.0, "llama3 smoothing", strict=True)
        if r.high_freq_factor <= r.low_freq_factor:
            raise ConfigError("model.rope.high_freq_factor", f"must exceed model.rope.low_freq_factor="
                              f"{r.low_freq_factor:g} (llama3 smooths between the two wavelengths), "
                              f"got {r.high_freq_factor:g}")
        return
    _num("model.rope.beta_slow", r.beta_slow, 0.0, "yarn: rotations of the slowest kept dimension", strict=True)
    _num("model.rope.beta_fast", r.beta_fast, 0.0, "yarn", strict=True)
    if r.beta_fast < r.beta_slow:  # equal is a one-dim step (Kimi K2's 1.0/1.0; transformers widens it by 0.001)
        raise ConfigError("model.rope.beta_fast", f"must be at least model.rope.beta_slow={r.beta_slow:g} (yarn "
                          f"ramps between them), got {r.beta_fast:g}")
    _num("model.rope.mscale", r.mscale, 0.0, "yarn")
    _num("model.rope.mscale_all_dim", r.mscale_all_dim, 0.0, "yarn")
    _num("model.rope.attention_factor", r.attention_factor, 0.0, "yarn: scale of cos/sin", strict=True,
         nullable=True)


def _check_window(cfg: Config) -> None:
    m = cfg.model
    _int("model.sliding_window", m.sliding_window, 1, MAX_WINDOW,
         "tokens a query sees, itself included; null = full attention", nullable=True)
    _int("model.full_attention_every", m.full_attention_every, 0, 512, "every k-th layer full; 0 = all sliding")
    lt = m.layer_types
    if lt is None:
        if m.full_attention_every and m.sliding_window is None:
            raise ConfigError("model.full_attention_every", f"{m.full_attention_every} interleaves full and sliding "
                              "layers: it needs model.sliding_window (a positive window), or 0")
        return
    if len(lt) != m.n_layers:
        raise ConfigError("model.layer_types", f"has {len(lt)} entries but model.n_layers={m.n_layers}: one "
                          f"of {', '.join(LAYER_TYPES)} per layer")
    bad = [v for v in lt if v not in LAYER_TYPES]
    if bad:
        raise ConfigError("model.layer_types", f"'{bad[0]}' is not one of: {', '.join(LAYER_TYPES)}")
    if m.full_attention_every:
        raise ConfigError("model.full_attention_every", f"{m.full_attention_every} and model.layer_types both give "
                          "the pattern; use 0 with an explicit model.layer_types")
    if "sliding" in lt and m.sliding_window is None:
        raise ConfigError("model.sliding_window", "model.layer_types has sliding layers: set model.sliding_window "
                          "to a positive window (tokens a query sees, itself included)")


def _check_linear(cfg: Config) -> None:
    """Gated DeltaNet (model.linear, layer_types "linear"): its widths, the gated attention's keys,
    and the layouts not built for it, refused by name."""
    m, li = cfg.model, cfg.model.linear
    if not isinstance(m.attn_gate, bool):
        raise ConfigError("model.attn_gate", f"must be true or false, got {m.attn_gate!r}")
    _num("model.rotary_fraction", m.rotary_fraction, 0.0, "the share of each head RoPE turns; 1 = all", strict=True)
    if m.rotary_fraction > 1:
        raise ConfigError("model.rotary_fraction", f"must be in (0, 1] (the share of each head RoPE turns), "
                          f"got {m.rotary_fraction!r}")
    for name in ("k_heads", "v_heads", "head_k_dim", "head_v_dim", "conv_kernel", "chunk"):
        _int(f"model.linear.{name}", getattr(li, name), 0 if name in ("k_heads", "v_heads") else 1, 65536,
             "Gated DeltaNet's width" if name != "k_heads" else "0 = no linear layers")
    if li.proj not in LINEAR_PROJ:
        raise ConfigError("model.linear.proj", f"'{li.proj}' is not one of: {', '.join(LINEAR_PROJ)} (how Hugging "
                          "Face stores the projections: Qwen3-Next's fused, Qwen3.5's split)")
    linear = m.layer_types is not None and "linear" in m.layer_types
    if linear != (li.k_heads > 0):
        raise ConfigError("model.linear.k_heads", f"{li.k_heads} with {'' if linear else 'no '}\"linear\" entries in "
                          "model.layer_types: linear layers need k_heads > 0, and k_heads > 0 needs linear layers")
    if not linear:
        return
    if li.v_heads < li.k_heads or li.v_heads % li.k_heads:
        raise ConfigError("model.linear.v_heads", f"{li.v_heads} must be a positive multiple of model.linear.k_heads "
                          f"({li.k_heads})")
    cp, tail = cfg.parallel.cp, li.conv_kernel - 1
    if isinstance(cp, int) and cp > 1 and m.seq_len // (2 * cp) < tail:
        # under cp each zigzag chunk's conv reads the previous chunk's last K-1 inputs, and only those
        # (paralayer/parallel/context/linear_state.py)
        raise ConfigError("parallel.cp", f"{cp}: a zigzag chunk (model.seq_len {m.seq_len} / 2·cp = "
                          f"{m.seq_len // (2 * cp)} tokens) is shorter than the linear layers' conv tail "
                          f"(model.linear.conv_kernel − 1 = {tail}); valid cp: at most "
                          f"{max(1, m.seq_len // (2 * tail))}")


def _check_mla(cfg: Config) -> None:
    m = cfg.model
    a = m.mla
    _int("model.mla.kv_lora_rank", a.kv_lora_rank, 0, MAX_RANK, "the latent K/V width; 0 = MLA off")
    _int("model.mla.q_lora_rank", a.q_lora_rank, 1, MAX_RANK, "the latent q width; null = a plain q projection",
         nullable=True)
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _int(f"model.mla.{name}", getattr(a, name), 0, MAX_HEAD_DIM, "per-head width")
    if a.kv_lora_rank == 0:
        for name in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(a, name):
                raise ConfigError(f"model.mla.{name}", f"{getattr(a, name)} is an MLA width but "
                                  "model.mla.kv_lora_rank=0 (MLA off); set kv_lora_rank > 0 or this to 0/null")
        return
    if a.qk_rope_head_dim <= 0 or a.qk_rope_head_dim % 2:
        raise ConfigError("model.mla.qk_rope_head_dim", f"must be a positive even width with MLA on (model.mla."
                          f"kv_lora_rank={a.kv_lora_rank}; the decoupled RoPE key rotates pairs), "
                          f"got {a.qk_rope_head_dim}")
    if a.v_head_dim <= 0:
        raise ConfigError("model.mla.v_head_dim", f"must be positive with MLA (model.mla.kv_lora_rank="
                          f"{a.kv_lora_rank}), got {a.v_head_dim}")
    if m.head_dim is not None:
        raise ConfigError("model.head_dim", f"{m.head_dim} does not apply with MLA: the q/k width is "
                          "model.mla.qk_nope_head_dim + qk_rope_head_dim, the v width model.mla.v_head_dim; use null")
    if m.qk_norm:
        raise ConfigError("model.qk_norm", "true does not apply with MLA (its norms are on the latent q and kv); "
                          "use false")
    if m.n_kv_heads != m.n_heads:
        raise ConfigError("model.n_kv_heads", f"must equal model.n_heads={m.n_heads} with MLA (model.mla.kv_lora_rank="
                          f"{a.kv_lora_rank}: every head gets its own K/V from the latent), got {m.n_kv_heads}")


def _check_moe_routing(cfg: Config) -> None:
    m = cfg.model
    mo = m.moe
    _int("model.moe.first_k_dense", mo.first_k_dense, 0, m.n_layers, f"layers 0..k-1 dense, at most "
         f"model.n_layers={m.n_layers}")
    _int("model.moe.n_group", mo.n_group, 1, MAX_GROUPS, "expert groups; 1 = no routing by group")
    _int("model.moe.topk_group", mo.topk_group, 1, MAX_GROUPS, "groups a token may route to")
    _num("model.moe.routed_scaling_factor", mo.routed_scaling_factor, 0.0, "the routed weights' scale", strict=True)
    _num("model.moe.seq_aux_loss_coef", mo.seq_aux_loss_coef, 0.0, "the sequence-wise balance loss; 0 = off")
    if mo.norm_topk_prob is not None and not isinstance(mo.norm_topk_prob, bool):
        raise ConfigError("model.moe.norm_topk_prob", f"must be true, false or null, got {mo.norm_topk_prob!r}")
    if mo.topk_group > mo.n_group:
        raise ConfigError("model.moe.topk_group", f"{mo.topk_group} exceeds model.moe.n_group={mo.n_group}; valid "
                          f"topk_group: 1..{mo.n_group}")
    E = mo.num_experts
    if mo.n_group == 1 or E == 0:
        return
    if E % mo.n_group:
        divs = [d for d in range(1, E + 1) if E % d == 0 and E // d >= 2]
        raise ConfigError("model.moe.n_group", f"{mo.n_group} does not divide model.moe.num_experts={E}; valid "
                          f"n_group: {', '.join(map(str, divs[:12]))}")
    per = E // mo.n_group
    if per < 2:
        raise ConfigError("model.moe.n_group", f"{mo.n_group} groups of {E} experts leave {per} per group; a "
                          "group is scored by its best two experts, so each needs at least 2")
    if mo.top_k > mo.topk_group * per:
        raise ConfigError("model.moe.top_k", f"{mo.top_k} exceeds model.moe.topk_group·(experts per group) = "
                          f"{mo.topk_group}·{per} = {mo.topk_group * per} (model.moe.n_group={mo.n_group}), the experts a token can "
                          "reach")
    if mo.router != "sigmoid":
        raise ConfigError("model.moe.n_group", f"{mo.n_group}: routing by group is DeepSeek-V3's sigmoid router; "
                          f"use model.moe.router=sigmoid or n_group=1 (router={mo.router})")


def _check_mtp(cfg: Config) -> None:
    m = cfg.model
    _int("model.mtp.depth", m.mtp.depth, 0, MAX_MTP_DEPTH, "extra predicted tokens; 0 = off")
    _num("model.mtp.loss_weight", m.mtp.loss_weight, 0.0, "lambda")
    if m.mtp.depth and m.mtp.depth >= m.seq_len - 1:
        raise ConfigError("model.mtp.depth", f"{m.mtp.depth} needs model.seq_len > depth + 1 (each depth predicts "
                          f"one token further), got seq_len={m.seq_len}")
