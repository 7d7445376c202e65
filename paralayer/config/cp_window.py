"""Which K/V chunks a sliding-window layer moves under context parallel: torch-free, so the runtime
(paralayer/parallel/context/window_ring.py) and the planner's communication count read one definition.

Zigzag: 2·cp chunks of c tokens, rank r holds chunks r and 2cp−1−r (slots 0 and 1). Query chunk a
sees key chunk b only when a ≥ b and (a−b)·c − (c−1) < w. Per layer call the forward sends
:func:`chunk_sends` K/V chunks (each 2·b·n_kv_heads·c·head_dim elements, the activations' dtype)
over all ranks, and the backward returns as many partial dK/dV chunks in fp32."""
from __future__ import annotations

from typing import Optional


def block_kind(a: int, b: int, c: int, w: int) -> Optional[str]:
    """How query chunk ``a`` sees key chunk ``b`` (chunks of ``c`` tokens, window ``w``):
    None (not at all), "causal" (the diagonal, w ≥ c), "full", or "mask" (partly)."""
    if b > a or (a - b) * c - (c - 1) >= w:
        return None
    if a == b:
        return "causal" if w >= c else "mask"
    return "full" if (a - b) * c + (c - 1) < w else "mask"


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def needed(cp: int, dst: int, c: int, w: int) -> dict[int, list[int]]:
    """{src rank: its chunk slots (0 = first, 1 = second) that rank ``dst``'s queries see}, src != dst."""
    out: dict[int, list[int]] = {}
    for src in range(cp):
        if src == dst:
            continue
        slots = [s for s, b in enumerate(chunks_of(cp, src))
                 if any(block_kind(a, b, c, w) for a in chunks_of(cp, dst))]
        if slots:
            out[src] = slots
    return out


def blocks(cp: int, rank: int, c: int, w: int) -> list[tuple[int, int, int, str, int, int]]:
    """(src rank, key slot, query slot, kind, a, b) for every visible block, own diagonals first."""
    out = []
    for q_slot, a in enumerate(chunks_of(cp, rank)):
        for src in range(cp):
            for k_slot, b in enumerate(chunks_of(cp, src)):
                kind = block_kind(a, b, c, w)
                if kind:
                    out.append((src, k_slot, q_slot, kind, a, b))
    return sorted(out, key=lambda t: (t[4] != t[5], t[0] != rank))


def chunk_sends(cp: int, c: int, w: int) -> int:
    """K/V chunks sent per layer call over all ranks (the forward; backward returns as many dK/dV)."""
    return sum(len(s) for dst in range(cp) for s in needed(cp, dst, c, w).values())
