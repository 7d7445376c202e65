"""What a Gated DeltaNet layer (Qwen3-Next's "linear" layers, paralayer/model/linear/) saves for
backward, per token, in place of the attention's set (``activations.attn_saved_elems``).

Why its own module: the layer is not attention, and none of the attention's fit applies to it (the
plan counted a GQA set there: tiny-qwen3-next rehearsed 39.2 MB against 25.0 MB planned). Counted
from the layer's code and held to the measured saved set (tests/test_linear_activations.py: one
layer, and the whole block, varying every width, the chunk and a sequence that is not a multiple
of it). Per token on one tp rank, fp32 elements (H = v_heads/t, Hk = k_heads/t, channels
c = (2·k_heads·dk + v_heads·dv)/t, S the sequence padded to the chunk C, n = S/C chunks):

    in_proj's input                   h            (the norm's output; whole on every tp rank, as
                                                    GQA's d_model-wide term; under SP DTensor's
                                                    gathered input, kept whole: ``activations``
                                                    counts it as h, not h/t, in ``gathered``)
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

Under context parallel (cp > 1, s = seq_len/cp the rank's tokens; parallel/context/linear_state.py)
the rule runs inside ``_SnakeRule``, which keeps only its inputs and the two states it received and
reruns each half-shard's rule in backward, so in place of the chunked rule's set above:

    q and k (l2norm's outputs, k heads), g          2Hk·dk + H        (v is the conv's output and
                                                                        beta sigmoid's: counted)
    the two received states, per microbatch        2H·dk·dv / s      (fp32)
    the conv: each half reads its own K−1 tail      c·(s+2(K−1))/s + 2c

and, in bf16, SiLU's output stays (v is a view of it: no "− channels"), the rule's inputs and
states are fp32 (under autocast no bf16 casts of the rule are kept). The rerun's own set (the
chunked rule over s/2 tokens, padded to C, its first state the saved one) lives once, one layer
at a time: :func:`cp_rerun_elems`, the transient ``activations.rerun_extra`` adds at the peak
beyond what the block's backward freed before it (its FFN's set and the gated norm's). Held to
one cp rank's layer in one process (tests/test_block_activations.py: a one-rank snake) and to the
rehearsal: tiny-qwen3.5 at cp2 read activations 0.684 of the plan before, 0.9990 now (0.9945
under full recompute, 0.9905 on pp rank 0 of pp2, where the transient counts).
The transient is an upper bound: the block's other tensors freed before the rerun (the FFN norm's,
the layers above it) are not subtracted.

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
    if lay.cp > 1:  # the zigzag shard's two conv tails, and the rule's inputs and states (module docstring)
        conv = channels * (s + 2 * (k - 1)) / s + 2 * channels
        rule = _cp_rule(cfg, lay)
    # the gate z: a copy of its part of in_proj_qkvz's output, but a view of the whole output
    # where a rank holds one k-head (the split is then contiguous): silu keeps that storage
    z = hv * dv if hk > lay.tp else 2 * hk * dk + 2 * hv * dv
    norm = 5 * hv * dv + hv + z
    return conv, gates, rule, norm


def linear_norm_elems(cfg: Config, lay: Layout) -> float:
    """The gated norm's part of :func:`linear_saved_elems` (out_proj's input with it), whole width."""
    return _parts(cfg, lay)[3]


def _cp_rule(cfg: Config, lay: Layout) -> float:
    """Under cp what ``_SnakeRule`` keeps of the rule, fp32 elements per token, whole width: q and k
    (l2norm's outputs, k heads), g, and the two received states (b, h_v, d_k, d_v) per microbatch
    (v is a view of the conv's output and beta sigmoid's, both counted already)."""
    li = cfg.model.linear
    s = cfg.model.seq_len / lay.cp
    return 2 * li.k_heads * li.head_k_dim + li.v_heads + 2 * li.v_heads * li.head_k_dim * li.head_v_dim / s


def cp_rerun_elems(cfg: Config, lay: Layout, mode: str) -> float:
    """Under cp, what one half-chunk's rerun of the rule saves while the backward differentiates it
    (``_rule_grads``: the chunked rule's set over c = s/2 tokens, padded to the chunk, its first
    state the saved one), per token of the rank's s on one tp rank, in units of ``ACT_BYTES`` of the
    precision (``mode``: states.precision_mode); not its C×C causal mask (bool, one a rank and
    microbatch: C² bytes, as at cp = 1). 0 at cp = 1. One layer's, once: a transient."""
    if lay.cp == 1:
        return 0.0
    li = cfg.model.linear
    dk, dv, c, hv = li.head_k_dim, li.head_v_dim, li.chunk, li.v_heads
    s = cfg.model.seq_len / lay.cp
    half = s / 2
    padded = -(-half // c) * c
    chunks = padded / c
    if mode == "bf16-autocast":  # _autocast_total's rule and loop, every chunk's casts and decay (s0 needs a gradient)
        rule = hv * (12 * dk + 4 * dv + 6 * c + 8) * padded
        loop = chunks * hv * (4 * dk * dv + c * c + 2 * c * dv + 3 * c * dk + 2) - 2 * hv * dk * dv
        return (rule + loop) / s / lay.tp
    rerun = (hv * (6 * dk + 3 * dv + 5 * c + 4) * padded + chunks * hv * (dk * dv + 1) - hv * dk * dv) / s / lay.tp
    return 2 * rerun if mode == "bf16-fsdp" else rerun


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
    if lay.cp > 1:  # v, a view of SiLU's bf16 output, is _SnakeRule's input: kept (rule: _cp_rule, all fp32)
        channels = 0
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
    if lay.cp > 1:  # the conv's two tails and SiLU's output (v, _SnakeRule's input); the rule's inputs
        pre = channels * (s + 2 * (k - 1)) / s + 2 * channels + 4 * hk * dk + 4 * hk + 5 * hv
        rule, loop = 2 * _cp_rule(cfg, lay), 0.0
    return pre + rule + loop + 9 * hv * dv + 2 * hv
