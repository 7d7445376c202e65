"""The Gated DeltaNet layer's delta rule as the rehearsal counts it: forward, backward and cp's
rerun on one tp rank (the plan's ``rank_flops`` beside ``--rehearse``'s FLOP counter, which counts
the triangular solves and the depthwise conv's backward per group: rehearse/flops.py). Model
FLOPs (MFU) keep ``model_parts.linear_core_fwd_flops`` × 3."""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.rules import Layout


def linear_core_rank_flops(cfg: Config, lay: Layout) -> tuple[float, float]:
    """(forward, whole step without recompute) FLOPs per token of one Gated DeltaNet layer's core
    on one tp rank (heads and conv channels split): the delta rule over each rank's own padded
    chunks (cp: two zigzag halves of s/2cp tokens), forward once, backward twice its GEMMs and
    three times its two triangular solves (a solve with the transposed matrix and a GEMM for the
    matrix's gradient), and under cp a second forward of the rule (not the conv) that the backward
    reruns (parallel/context/linear_state.py)."""
    m, li = cfg.model, cfg.model.linear
    if not li.k_heads:
        return 0.0, 0.0
    c, dk, dv, t = li.chunk, li.head_k_dim, li.head_v_dim, lay.tp
    piece = m.seq_len / (2 * lay.cp) if lay.cp > 1 else m.seq_len
    fwd = parts.linear_core_fwd_flops(cfg, piece) / t
    conv = 2.0 * li.conv_kernel * (2 * li.k_heads * dk + li.v_heads * dv) / t
    solves = li.v_heads * c * (dk + dv) * (-(-piece // c) * c / piece) / t
    if lay.cp > 1:
        return fwd, 3.0 * fwd + solves + fwd - conv
    # one rank holds the whole sequence: the first chunk's two reads of the (zero) state need no
    # state gradient and the last chunk's write (the unused final state) none at all: four GEMMs of
    # 2C·dk·dv a sequence fewer in backward
    ends = 8.0 * c * dk * dv * li.v_heads / m.seq_len / t
    return fwd, 3.0 * fwd + solves - ends
