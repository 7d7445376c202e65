"""What a cp rank sends outside the full K/V ring (torch-free; cost/terms.py's cp traffic adds them):

- a sliding-window layer (parallel/context/window_ring.py): its own chunks straight to the ranks
  whose queries see them (:func:`window_sends`, config/cp_window.py's plan of the sends);
- a Gated DeltaNet layer (parallel/context/linear_state.py), per microbatch: cp rank r sends its
  chunks' final recurrent states and conv tails to the neighbours that read them in sequence order
  (the zigzag "snake": its lo chunk's to rank r+1, its hi chunk's to rank r−1), once in forward
  (again when full recompute reruns the layer) and their gradients once in backward. No K/V."""
from __future__ import annotations

import functools
from typing import Optional

from paralayer.config import Config, cp_window
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory import layer_recompute
from paralayer.resolve.rules import Layout


def window_sends(seq: int, cp: int, window: int, cp_rank: int) -> tuple[int, int]:
    """(chunks cp rank ``cp_rank`` sends per forward call of a windowed layer, chunks it receives
    = the dK/dV chunks it returns in backward), from config/cp_window.py's ``needed`` (the
    runtime's own plan of the sends)."""
    sent, got = _window_table(seq, cp, window)
    return sent[cp_rank], got[cp_rank]


@functools.lru_cache(maxsize=1024)
def _window_table(seq: int, cp: int, window: int) -> tuple[list[int], list[int]]:
    """Every cp rank's sends at once (one pass over the ranks, not one per rank: the planner
    weighs every cp rank of a windowed layout, cp up to a thousand)."""
    return cp_window.sends(cp, seq // (2 * cp), window)


def rank_sends(cp: int, cp_rank: int) -> int:
    """Messages of each kind (state, tail) cp rank ``cp_rank`` sends per linear layer forward: one
    to each neighbour it has (the ends of the snake have one, the middle ranks two)."""
    return int(cp_rank < cp - 1) + int(cp_rank > 0)


def busiest_sends(cp: int) -> int:
    """:func:`rank_sends` of the busiest cp rank (a middle one when cp > 2)."""
    return max((rank_sends(cp, r) for r in range(min(cp, 3))), default=0)


def message_bytes(cfg: Config, micro_batch: int, tp: int, act_bytes: float) -> tuple[float, float]:
    """(one recurrent state, one conv tail) in bytes on a tp rank: the state is (b, h_v/tp, d_k, d_v)
    in fp32, the tail the conv input's last K−1 positions, (b, K−1, channels/tp), in activations."""
    li = cfg.model.linear
    channels = 2 * li.k_heads * li.head_k_dim + li.v_heads * li.head_v_dim
    state = micro_batch * li.v_heads / tp * li.head_k_dim * li.head_v_dim * 4
    return state, micro_batch * (li.conv_kernel - 1) * channels / tp * act_bytes


def linear_cp_traffic(cfg: Config, lay: Layout, layers: list, act_bytes: float,
                      cp_rank: Optional[int] = None, again: Optional[dict] = None) -> tuple[int, int]:
    """(messages, bytes) per step a cp rank sends for the linear layers among ``layers`` (the
    busiest rank's when ``cp_rank`` is None): forward and backward, plus a forward's again for each
    layer full recompute reruns, and for each second rerun of a split backward (``again``, per
    step: cost.comm_facts.split_reruns)."""
    if lay.cp == 1 or cfg.model.linear.k_heads == 0:  # no linear layers (the planner asks per layout)
        return 0, 0
    n = busiest_sends(lay.cp) if cp_rank is None else rank_sends(lay.cp, cp_rank)
    state, tail = message_bytes(cfg, lay.micro_batch, lay.tp, act_bytes)
    kinds = 2 if cfg.model.linear.conv_kernel > 1 else 1
    tail = tail if kinds == 2 else 0.0
    lin = [i for i in layers if parts.is_linear_layer(cfg, i)]
    calls = sum(2 + (layer_recompute(lay, i) == "full") for i in lin) * lay.microbatches
    calls += sum((again or {}).get(i, 0) for i in lin)
    return int(calls * n * kinds), int(calls * n * (state + tail))
