"""What a bf16 run keeps in fp32 beyond the activations counted at 2 bytes (``activations``):
one row per part of a layer (the block's norms and casts, the attention by kind, the FFN), in
2-byte elements per token.

Why its own module: the precision's terms are their own rules (autocast against FSDP's mixed
precision, the parts' fp32 islands), measured apart from the fp32 fit; ``activations`` adds them
(``act_elems_per_token``).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.linear_acts import linear_bf16_extra
from paralayer.resolve.memory.states import precision_mode
from paralayer.resolve.rules import Layout


def bf16_extra_elems(cfg: Config, lay: Layout, mode: str, moe: bool = False, linear: bool = False) -> float:
    """What a bf16 run keeps in fp32, as extra 2-byte elements per token per layer (measured on
    our block at tp 1 and 2, with bf16 weights as FSDP's MixedPrecisionPolicy runs it and under
    autocast, tests/test_tensor_memory.py):

    - RMSNorm keeps its 1/rms in fp32: 2 more (split over tp under SP);
    - SDPA's logsumexp is fp32: a more (heads split over tp; recomputed under core_attn/selective);
    - autocast only (ZeRO 0/1: fp32 weights, ``precision_mode``): the residual stream is fp32, so
      are the norms' saved inputs: 2h more (/t under SP). The column GEMMs' saved shard (SP) is
      fp32 too: 2·h/t more; without SP every linear saves its own bf16 cast of the input: q, k, v
      three and w1, w3 two where one was counted: 3h more.
      Under full recompute the block's input is all that is kept, in fp32: h (h/t under SP) more.
    - qk_norm: its 1/rms per head, (a + g)/t more (Qwen3's widths, fake tensors, tp 1); under
      autocast with core_attn or selective the core's inputs q and k are the norms' fp32 outputs:
      (a + g)·head_dim/t more (not Gemma's offset norm, which casts back);
    - MLA: its two inner norms' 1/rms, 2 more; under autocast without SP two GEMMs read the
      attention norm's output (q_a or wq, and kv_a), not three: h fewer.
    - MoE: the router's scores are fp32, E more; under autocast each routed row's input is cast
      again for its expert's GEMM (not under ep, where the rows travel in bf16) and the router's
      input for its own: rows·h + h more, and 2h
      fewer without a shared expert (no w1/w3 cast of the whole token stream).
    The MLA and MoE terms were measured on one block of DeepSeek-V3's widths and of
    deepseek-v3-tiny's, with the rehearsal's GPU kernel (fake tensors) and on CPU, tp 1.

    One row per part (the block's norms and casts; the attention by kind, ``_ATTN_BF16``; the FFN,
    ``_FFN_BF16``): a new attention kind or FFN is one entry. Each part gives its terms in the order
    they are summed, so the sum is the same to the bit whatever the part's shape.
    """
    h = cfg.model.d_model
    autocast = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) == "bf16-autocast"
    if mode == "full":
        return (h / lay.tp if lay.sequence_parallel else h) if autocast else 0.0
    extra = 0.0
    block, attn = (_linear_block_bf16, _linear_bf16) if linear else (_block_bf16, _ATTN_BF16[parts.attention_kind(cfg)])
    for part in (block, attn, _FFN_BF16["moe" if moe else "mlp"]):
        for term in part(cfg, lay, mode, autocast):
            extra += term
    return extra


def _block_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """The norms' 1/rms (and under autocast their fp32 inputs), SDPA's logsumexp, autocast's casts."""
    h, a, t, sp = cfg.model.d_model, cfg.model.n_heads, lay.tp, lay.sequence_parallel
    terms = [(2 + (2 * h if autocast else 0)) / (t if sp else 1)]
    if cfg.model.post_norms:  # Gemma 3's two more norms keep their 1/rms in fp32 too
        terms.append(2 / (t if sp else 1))
    if mode not in ("core_attn", "selective"):
        terms.append(a / t)
    if autocast:
        terms.append(2 * h / t if sp else 3 * h)
    return terms


def _linear_block_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """:func:`_block_bf16` for a Gated DeltaNet layer: no SDPA logsumexp (as where the core is
    recomputed). Under autocast its input's casts for in_proj_qkvz and in_proj_ba, two where the
    attention's q, k, v make three, read the same as the attention's term (measured)."""
    return _block_bf16(cfg, lay, "core_attn", autocast)


def _gqa_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """qk_norm: the q and k norms' 1/rms per head (attn_saved_elems' a + g). Under autocast the
    norms' weights are fp32, so their outputs are fp32 (bf16 x normalised, times an fp32 weight:
    as transformers' Qwen3RMSNorm), and a recomputed core (core_attn, selective) keeps its inputs q
    and k as they come: q + kv more (qwen3-8b tp8 selective rehearsed activations 1.036 at 6
    layers, 1.020 at 2, without; "none" saves RoPE's bf16 casts, counted in the fit). Not Gemma's
    offset norm, whose output is cast back to bf16 (gemma3-27b's block reads 1.000 without it, 0.959 with)."""
    m = cfg.model
    if not m.qk_norm:
        return []
    terms = [(m.n_heads + m.n_kv_heads) / lay.tp]
    # Gemma's offset norm casts back to its input's dtype (model/norms.py): nothing more there
    if autocast and mode in ("core_attn", "selective") and not m.norm_offset:
        hd = parts.head_dim(cfg)
        terms.append((m.n_heads + m.n_kv_heads) * hd / lay.tp)
    return terms


def _mla_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """The two inner norms' 1/rms; two GEMMs read the attention norm's output, not three; under cp
    or CPU's math path the attention's fp32 copies."""
    m, t = cfg.model, lay.tp
    a, dqk, dv = m.n_heads, parts.qk_head_dim(cfg), parts.v_head_dim(cfg)
    terms = [2 - (m.d_model if autocast and not lay.sequence_parallel else 0)]
    if autocast and lay.cp > 1 and mode not in ("core_attn", "selective"):
        # the ring takes q and k as RoPE leaves them (fp32) and returns fp32: q, k, the output
        # count twice, and wo casts the output again
        terms.append(a * (2 * dqk + 2 * dv) / t)
    elif autocast and lay.device == "cpu" and mode not in ("core_attn", "selective") and dqk != dv:
        # CPU's math path (attn_saved_elems) runs in fp32 under autocast: q, k, v, the probabilities
        terms.append(a * (2 * dqk + dv + m.seq_len) / t)
    return terms


def _linear_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """A Gated DeltaNet layer under bf16 (linear_acts.linear_bf16_extra)."""
    return [linear_bf16_extra(cfg, lay, autocast)]


def _mlp_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """A dense FFN keeps nothing in fp32 beyond the block's terms."""
    return []


def _moe_bf16(cfg: Config, lay: Layout, mode: str, autocast: bool) -> list[float]:
    """The router's fp32 scores; under autocast the casts of the routed rows and the router's input
    (and without a shared expert no w1/w3 cast of the token stream: 2h fewer). Under ep the rows
    travel in bf16 (parallel/expert.py _wire_dtype): no cast at the experts."""
    mo = cfg.model.moe
    casts = (routed_rows_per_token(cfg) if lay.ep == 1 else 0) + 1 - (0 if mo.shared_ffn_hidden else 2)
    if mo.shared_gate and mo.shared_ffn_hidden:
        casts += 1  # Qwen3-Next's shared-expert gate casts the token stream for its own GEMM
    return [mo.num_experts + (casts * cfg.model.d_model if autocast else 0)]


#: What each part keeps in fp32 under bf16, by kind (model_parts.attention_kind; dense or MoE FFN).
_ATTN_BF16 = {"gqa": _gqa_bf16, "mla": _mla_bf16}
_FFN_BF16 = {"mlp": _mlp_bf16, "moe": _moe_bf16}


def routed_rows_per_token(cfg: Config) -> float:
    """Expert rows per token: top_k (dropless), or fewer when capacity_factor·top_k < top_k."""
    mo = cfg.model.moe
    if mo.capacity_factor is None:
        return float(mo.top_k)
    return min(float(mo.top_k), mo.top_k * mo.capacity_factor)
