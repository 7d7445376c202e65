"""config/cp_window.py: the chunks a windowed layer moves under cp, by reach (O(reach) per rank)
against the definition itself (every query chunk against every key chunk through block_kind).

Why: the planner asks every cp rank of thousands of layouts; the old all-pairs walk made
``--plan`` of gemma3-27b (62 windowed layers, 32K tokens, cp up to 256) take 230 s."""
from __future__ import annotations

from paralayer.config import cp_window
from paralayer.resolve.cost import window_sends
from tests.cpu_budget import cpu_within


def _needed_by_definition(cp: int, dst: int, c: int, w: int) -> dict[int, list[int]]:
    out = {}
    for src in range(cp):
        if src == dst:
            continue
        slots = [s for s, b in enumerate(cp_window.chunks_of(cp, src))
                 if any(cp_window.block_kind(a, b, c, w) for a in cp_window.chunks_of(cp, dst))]
        if slots:
            out[src] = slots
    return out


CASES = [(cp, c, w) for cp in (1, 2, 3, 4, 5, 8, 16) for c in (1, 2, 3, 7, 16, 64)
         for w in (1, 2, 3, 5, 16, 63, 64, 65, 128, 129, 1000)]


def test_needed_equals_the_definition_for_every_rank():
    for cp, c, w in CASES:
        for dst in range(cp):
            assert cp_window.needed(cp, dst, c, w) == _needed_by_definition(cp, dst, c, w), (cp, dst, c, w)


def test_sends_per_rank_equal_the_definition_and_the_planner_reads_them():
    for cp, c, w in CASES:
        want_sent = [sum(len(_needed_by_definition(cp, d, c, w).get(r, ())) for d in range(cp)) for r in range(cp)]
        want_got = [sum(len(v) for v in _needed_by_definition(cp, r, c, w).values()) for r in range(cp)]
        assert cp_window.sends(cp, c, w) == (want_sent, want_got), (cp, c, w)
        for r in range(cp):
            assert window_sends(2 * cp * c, cp, w, r) == (want_sent[r], want_got[r])


def test_a_planted_off_by_one_reach_fails(monkeypatch):
    monkeypatch.setattr(cp_window, "reach", lambda c, w: (w + c - 1) // c)
    bad = [(cp, c, w) for cp, c, w in CASES for d in range(cp)
           if cp_window.needed(cp, d, c, w) != _needed_by_definition(cp, d, c, w)]
    assert bad


def test_every_rank_of_cp_1024_in_well_under_a_second():
    cpu, allowed, (sent, got) = cpu_within(lambda: cp_window.sends(1024, 32, 1024), 0.5)
    assert cpu < allowed, (cpu, allowed)
    assert sum(sent) == sum(got) > 0
