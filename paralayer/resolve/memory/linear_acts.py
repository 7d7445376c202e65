"""What a Gated DeltaNet layer (Qwen3-Next's "linear" layers, paralayer/model/linear/) saves for
backward, per token, in place of the attention's set (``activations.attn_saved_elems``).

Why its own module: the layer is not attention, and none of the attention's fit applies to it (the
plan counted a GQA set there: tiny-qwen3-next rehearsed 39.2 MB against 25.0 MB planned). Counted
from the layer's code and held to the measured saved set (tests/test_linear_activations.py: one
layer, and the whole block, varying every width, the chunk and a sequence that is not a multiple
of it). Per token on one tp rank, fp32 elements (H = v_heads/t, Hk = k_heads/t, channels
c = (2·k_heads·dk + v_heads·dv)/t, S the sequence padded to the chunk C, n = S/C chunks):

    in_proj's input                   h            (the norm's output; whole on every tp rank, as
                                                    GQA's d_model-wide term)
    the conv                          c·(s+K−1)/s  (its input with the K−1 zeros before it)
                                      + 2c         (its output, SiLU's input; SiLU's output, the
                                                    l2norms' and v's source)
    l2norm's 1/rms of q and k         2Hk
    beta (sigmoid's output), softplus's input and output   3H
    the chunked rule (model/linear/delta_rule.py), over S:
        q, k, k·beta, w, q·decay, k·decay-to-end          6H·dk
        v, u, v_new                                      3H·dv
        the decay matrix, k·beta·kᵀ, A, q·kᵀ, the masked scores   5H·C
        beta and three exps of the cumulated gate          4H
      and per chunk the state it reads (H·dk·dv) and its decay (H)
    the gated norm                    6H·dv + H    (its input, 1/rms, the normed, the gain's
                                                    output, z, silu(z); out_proj's input); where a
                                                    rank holds one k-head z is a view of in_proj_qkvz's
                                                    whole output: 5H·dv + H + 2Hk·dk + 2H·dv

Not counted: what is per microbatch rather than per token (the chunk's C×C causal mask, A_log's
exp, under tp the conv weight's rows): 4 KB and less a layer. The layer has no recomputed core:
core_attn and selective keep its whole set (only its FFN's SwiGLU is recomputed there).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.rules import Layout


def linear_saved_elems(cfg: Config, lay: Layout) -> float:
    """The layer's saved elements per token before the tp split (``activations._act_elems`` divides
    the attention's set by tp): ``t`` times one rank's set, its d_model-wide input counted once."""
    conv, gates, rule, norm = _parts(cfg, lay)
    return cfg.model.d_model + conv + gates + rule + norm


def _parts(cfg: Config, lay: Layout) -> tuple[float, float, float, float]:
    """(conv with SiLU's output, the gates and l2norms' 1/rms, the chunked rule, the gated norm)
    in fp32 elements per token, whole width (the module docstring)."""
    m, li = cfg.model, cfg.model.linear
    dk, dv, k, c = li.head_k_dim, li.head_v_dim, li.conv_kernel, li.chunk
    hv, hk = li.v_heads, li.k_heads
    s = m.seq_len / lay.cp  # the tokens of one rank's sequence (a chunk rule per rank under cp)
    padded = -(-s // c) * c
    chunks = padded / c
    channels = 2 * hk * dk + hv * dv
    conv = channels * (s + k - 1) / s + 2 * channels
    gates = 2 * hk + 3 * hv
    rule = hv * (6 * dk + 3 * dv + 5 * c + 4) * padded / s + chunks * hv * (dk * dv + 1) / s
    # the gate z: a copy of its part of in_proj_qkvz's output, but a view of the whole output
    # where a rank holds one k-head (the split is then contiguous): silu keeps that storage
    z = hv * dv if hk > lay.tp else 2 * hk * dk + 2 * hv * dv
    norm = 5 * hv * dv + hv + z
    return conv, gates, rule, norm


def linear_bf16_extra(cfg: Config, lay: Layout, autocast: bool) -> float:
    """Under bf16, what the layer keeps beyond :func:`linear_saved_elems` counted at 2 bytes, as
    extra 2-byte elements per token (whole width, split by tp with the rest).

    Under FSDP's mixed precision (bf16 weights): the chunked rule runs in fp32
    (model/linear/delta_rule.py promotes its inputs), so it counts twice; l2norm keeps fp32 copies
    of q and k instead of SiLU's bf16 output (4·k_heads·dk − channels) and its 1/rms (2·k_heads);
    softplus's input and output are fp32 (2·v_heads); the gated norm keeps its input, 1/rms, the
    gate and silu(gate) in fp32, the normed value, its product and out_proj's input in bf16
    (3·v_heads·dv + v_heads more). Under autocast (ZeRO 0/1) the rule's matmuls also save their
    bf16 casts: :func:`_autocast_total` counts them."""
    li = cfg.model.linear
    hk, hv, dk, dv = li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim
    if autocast:
        return _autocast_total(cfg, lay) - (linear_saved_elems(cfg, lay) - cfg.model.d_model)
    _, _, rule, norm = _parts(cfg, lay)
    channels = 2 * hk * dk + hv * dv
    return (4 * hk * dk - channels) + 2 * hk + 2 * hv + rule + (9 * hv * dv + 2 * hv - norm)


def _autocast_total(cfg: Config, lay: Layout) -> float:
    """The layer's saved set under autocast in 2-byte elements per token, whole width, its input
    aside (measured at tiny-qwen3-next's widths, one term per saved tensor of the listing):

        the conv's input and output (bf16), l2norm's fp32 copies of q, k and their 1/rms,
        beta (bf16), softplus's fp32 input and output:    c·(s+K−1)/s + c + 4Hk·dk + 4Hk + 5H
        the rule outside its loop, over S:  12H·dk + 4H·dv + 6H·C + 8H  (fp32 q, k, v, k·beta, w,
            q·decay, u, the decay matrix and A; the bf16 casts and products of k·beta·kᵀ and q·kᵀ)
        its loop, per chunk: the state cast twice and kept in fp32 (4H·dk·dv), the scores' cast
            (H·C²), v_new cast twice (2H·C·dv), k·decay-to-end's cast (H·C·dk), and past the first
            chunk (whose zero state needs no gradient) w's and q·decay's casts (2H·C·dk)
        the gated norm:                                     9H·dv + 2H
    """
    m, li = cfg.model, cfg.model.linear
    dk, dv, k, c = li.head_k_dim, li.head_v_dim, li.conv_kernel, li.chunk
    hv, hk = li.v_heads, li.k_heads
    s = m.seq_len / lay.cp
    padded = -(-s // c) * c
    chunks = padded / c
    channels = 2 * hk * dk + hv * dv
    pre = channels * (s + k - 1) / s + channels + 4 * hk * dk + 4 * hk + 5 * hv
    rule = hv * (12 * dk + 4 * dv + 6 * c + 8) * padded / s
    loop = (chunks * hv * (4 * dk * dv + c * c + 2 * c * dv + c * dk) + (chunks - 1) * 2 * hv * c * dk) / s
    return pre + rule + loop + 9 * hv * dv + 2 * hv
