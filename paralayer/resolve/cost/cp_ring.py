"""cp of ``cost.comm``: the ring's K/V blocks and their fp32 dK/dV, the window ring's chunks, and
the Gated DeltaNet layers' states and conv tails (cost/cp_sends.py), with every rerun of them, and
the FP8 blocks' amax all-reduces (resolve/fp8_blocks.py cp_amax).

Why its own module: the cp entry sorts the rank's layers by how their attention crosses cp and
counts each kind apart; cost/terms.py keeps the other axes. Torch-free."""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import fp8_blocks
from paralayer.resolve import model_parts as parts
from paralayer.resolve.cost.comm_facts import config_cache
from paralayer.resolve.cost.cp_sends import linear_cp_traffic, window_sends
from paralayer.resolve.cost.entry import autocast, entry, with_reruns
from paralayer.resolve.memory import layer_recompute
from paralayer.resolve.rules import Layout


def cp_comm(cfg: Config, lay: Layout, tokens: float, ab: float, layers: list, n_full: int,
             cp_rank: int | None = None, again: dict | None = None) -> dict:
    """cp of :func:`cost.terms.comm`: the ring's K/V blocks and, in backward, the fp32 partial dK/dV. K is
    n_kv·d_qk wide, V n_kv·d_v (MLA: every head's, nope+rope and v_head_dim). A windowed layer
    runs parallel/window_ring.py, not the ring: each rank sends its own chunks once per forward
    (again when recompute reruns it) straight to the ranks whose queries see them, and in
    backward the partial dK/dV of every chunk it received goes home in fp32; no K/V moves in
    backward (:func:`window_sends`, config/cp_window.py's definition). The figure is ``cp_rank``'s,
    or the busiest cp rank's (the ranks differ under a window). ``again``: :func:`split_reruns`."""
    if lay.cp == 1:
        return entry("none", 0, 0, 1)
    again = again or {}
    mm = lay.microbatches
    kv_elems = tokens * parts.kv_heads(cfg) * (parts.qk_head_dim(cfg) + parts.v_head_dim(cfg)) / lay.tp
    # under autocast RoPE meets the fp32 stream's cos/sin: K (and V, sent with it) travel in fp32
    kv = kv_elems * (4 if autocast(lay) else ab)
    kv_full, dkv_full, win_calls, n_win = ring_counts(cfg, lay, layers)
    ring_again = win_again = 0
    for i, n in again.items():
        kind = ring_kind(cfg, i)
        ring_again += n if kind == "ring" else 0
        win_again += n if kind == "window" else 0
    # per step: the microbatches' sends and the split backwards' second reruns
    kv_again = ring_again * (lay.cp - 1)
    best = (0.0, kv_full * mm + kv_again, dkv_full * mm, kv_again)
    if n_win:
        best = None
        for cr in (range(lay.cp) if cp_rank is None else (cp_rank,)):
            sent, got = window_sends(cfg.model.seq_len, lay.cp, cfg.model.sliding_window, cr)
            again_s = kv_again + sent / 2 * win_again  # chunks are half a block
            kv_s = kv_full * mm + sent / 2 * win_calls * mm + again_s
            dkv_s = (dkv_full + got / 2 * n_win) * mm  # the received chunks' dK/dV, fp32
            got_bytes = kv_s * kv + dkv_s * kv_elems * 4
            if best is None or got_bytes > best[0]:
                best = (got_bytes, kv_s, dkv_s, again_s)
    _, kv_sends, dkv_sends, kv_again = best
    lin_msgs, lin_bytes = linear_cp_traffic(cfg, lay, layers, ab, cp_rank, again)  # Gated DeltaNet: states, tails
    lin_again = (0, 0)
    if again and lin_msgs:
        once = linear_cp_traffic(cfg, lay, layers, ab, cp_rank)
        lin_again = (lin_msgs - once[0], lin_bytes - once[1])
    e = entry("ring send/recv (K,V)" + (" + state/tail send/recv" if lin_msgs else ""), kv,
               kv_sends + dkv_sends + lin_msgs, lay.cp)
    e["bytes_per_step"] = int(kv_sends * kv + dkv_sends * kv_elems * 4) + lin_bytes
    amax, n_amax = fp8_blocks.cp_amax(cfg, lay, layers, lambda i: layer_recompute(lay, i) == "full")
    if n_amax:  # FP8 scales over the cp group: small all-reduces per microbatch
        e["count_per_step"] += n_amax * mm
        e["bytes_per_step"] += int(amax * mm)
    return with_reruns(e, kv_again + lin_again[0], kv_again * kv + lin_again[1])


def ring_counts(cfg: Config, lay: Layout, layers: list) -> tuple[float, float, int, int]:
    """:func:`cp_comm`'s ring over ``layers`` per microbatch: (full-ring K/V block sends, their
    dK/dV sends, windowed layers' forward calls with reruns, windowed layers), counted once per
    (layers, recompute, k) on the config and times the layout's cp."""
    cache = config_cache(cfg)  # the counts depend on the layers and the recompute alone
    key = ("ring", tuple(layers), lay.recompute, lay.recompute_every)
    hit = cache.get(key)
    if hit is None:
        # core_attn / selective recompute rerun the attention core (the ring) as full recompute
        # does on its layers
        rerun_all = lay.recompute in ("core_attn", "selective")
        calls = n_ring = 0        # full-ring layers: forward calls (with reruns) and backward, layers
        win_calls = n_win = 0     # windowed layers: forward calls (with reruns), layers
        for i in layers:
            kind = ring_kind(cfg, i)
            if kind == "linear":
                continue
            reruns = 1 if (rerun_all or layer_recompute(lay, i) == "full") else 0
            if kind == "ring":
                calls += 2 + reruns  # forward (+ rerun), backward
                n_ring += 1          # partial dK/dV in fp32: cp hops home
            else:
                win_calls += 1 + reruns
                n_win += 1
        hit = cache[key] = (calls, n_ring, win_calls, n_win)
    calls, n_ring, win_calls, n_win = hit
    # in K/V blocks of the rank's 2 chunks: integers, so the products are the per-layer sums exactly
    return 0.0 + calls * (lay.cp - 1), 0.0 + n_ring * lay.cp, win_calls, n_win


def ring_kind(cfg: Config, i: int) -> str:
    """How layer i's attention crosses cp: "linear" (Gated DeltaNet states), "window" (the window
    ring) or "ring" (the full ring), as :func:`ring_counts` sorts them."""
    m = cfg.model
    if m.linear.k_heads != 0 and parts.is_linear_layer(cfg, i):
        return "linear"
    w = m.sliding_window
    if w is None or w >= m.seq_len or parts.layer_window(cfg, i) is None:
        return "ring"
    return "window"
