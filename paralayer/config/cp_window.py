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


def reach(c: int, w: int) -> int:
    """How many chunks back a query chunk sees: key chunk b is visible from query chunk a iff
    0 <= a - b <= reach (:func:`block_kind`'s test, (a - b)·c - (c - 1) < w, solved for a - b)."""
    return (w + c - 2) // c


def owner(cp: int, b: int) -> tuple[int, int]:
    """(rank, slot) holding zigzag chunk ``b``."""
    return (b, 0) if b < cp else (2 * cp - 1 - b, 1)


def needed(cp: int, dst: int, c: int, w: int) -> dict[int, list[int]]:
    """{src rank: its chunk slots (0 = first, 1 = second) that rank ``dst``'s queries see}, src != dst.
    O(reach) per rank: the planner asks it for every cp rank of thousands of layouts."""
    d = reach(c, w)
    out: dict[int, set[int]] = {}
    for a in chunks_of(cp, dst):
        for b in range(max(0, a - d), a + 1):
            src, slot = owner(cp, b)
            if src != dst:
                out.setdefault(src, set()).add(slot)
    return {src: sorted(out[src]) for src in sorted(out)}


def sends(cp: int, c: int, w: int) -> tuple[list[int], list[int]]:
    """Per rank: (K/V chunks it sends per forward call, chunks it receives = the dK/dV chunks it
    returns in backward)."""
    sent, got = [0] * cp, [0] * cp
    for dst in range(cp):
        for src, slots in needed(cp, dst, c, w).items():
            sent[src] += len(slots)
            got[dst] += len(slots)
    return sent, got


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
