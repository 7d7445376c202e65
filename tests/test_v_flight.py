"""The V schedules' in-flight counts (paralayer/resolve/memory/v_flight.py) are torch's own orders.

The memory plan under zbv and dualpipev takes its peak over a rank's backward passes
(memory.v_rank_activations), so the order it walks must be the one torch runs: the same actions,
kinds and chunks for every rank of p = 2..16 and several m (DualPipeV needs m >= 2p).
"""
from __future__ import annotations

import pytest

from paralayer.resolve.memory import v_flight


def _torch_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int]]:
    from torch.distributed.pipelining import schedules as S

    cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[schedule]
    sched = cls.__new__(cls)  # the order needs only these three numbers, not stages
    sched._n_microbatches, sched.pp_group_size, sched.num_stages = m, p, 2 * p
    stages = (rank, 2 * p - 1 - rank)
    out = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is None:
            continue
        for x in a.sub_actions or (a,):  # an overlapped F;B is its forward, then its full backward
            out.append((x.computation_type.value, stages.index(x.stage_index)))
    return out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_order_is_torchs(schedule):
    n = 0
    for p in range(2, 17):
        for m in sorted({p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2, 8 * p, 120}):
            if m < (2 * p if schedule == "dualpipev" else p):
                continue
            for rank in range(p):
                assert v_flight.v_order(schedule, p, m, rank) == _torch_order(schedule, p, m, rank), (p, m, rank)
                n += 1
    assert n > 500


def test_a_planted_order_error_fails():
    """The comparison can fail: DualPipeV with its last rank's first pair overlapped the other way
    round (B before F) is not torch's order."""
    p, m, r = 4, 8, 3
    good = v_flight.v_order("dualpipev", p, m, r)
    i = good.index(("B", 1))
    planted = good[:i - 1] + [good[i], good[i - 1]] + good[i + 1:]
    assert planted != _torch_order("dualpipev", p, m, r)
    assert good == _torch_order("dualpipev", p, m, r)


def test_dualpipev_last_rank_splits_with_fewer_in_flight():
    """DualPipeV's full backwards see 2p + 1 chunk-microbatches on every rank; the last rank's
    split passes come only after its forwards end, with p in flight (DeepSeek-V3's pp 16: 16, not
    33), while the first rank splits its last chunk with 2p of them."""
    p, m = 16, 120
    last = v_flight.moments("dualpipev", p, m, p - 1)
    assert max(mo.held0 + mo.held1 for mo in last if not mo.split) == 2 * p + 1
    assert max(mo.held0 + mo.held1 for mo in last if mo.split) == p
    first = v_flight.moments("dualpipev", p, m, 0)
    assert max(mo.held0 + mo.held1 for mo in first if not mo.split) == 2 * p + 1
    assert max(mo.held0 + mo.held1 for mo in first if mo.split and mo.chunk == 1) == 2 * p
    # ZB-V splits every backward; its first rank holds 2p chunk-microbatches (1F1B's p, twice the chunks)
    zb = v_flight.moments("zbv", 4, 8, 0)
    assert all(mo.split for mo in zb) and max(mo.held0 + mo.held1 for mo in zb) == 8


def _rehearse_dualpipev_pp4() -> tuple:
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

    cfg = config_mod.load_config(["recipe=tiny-moe", "parallel.pp=4", "parallel.schedule=dualpipev",
                                  "parallel.recompute=full", "model.n_layers=16", "train.micro_batch=1",
                                  "train.global_batch=16", "train.precision=fp32"])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    out = R.rehearse(cfg, plan, [0, 6])  # the first and the last pipeline rank (dp 2)
    assert out["ok"] and len(out["ranks"]) == 2, out.get("errors")
    return cfg, plan, out["ranks"]


def test_dualpipev_full_recompute_rehearses_the_plans_activations(monkeypatch):
    """tiny-moe pp4 dualpipev, two blocks per chunk, full recompute: the last rank's split passes
    keep a chunk's two recomputed sets with p chunk-microbatches in flight, its full backwards one
    layer's with 2p + 1. The plan takes the larger moment on every rank: within 1%. Planted: the
    earlier plan (2p + 1 in flight beside a whole chunk's transient) over-counts the last rank."""
    from paralayer import rehearse as R

    cfg, plan, ranks = _rehearse_dualpipev_pp4()
    for r in ranks:
        assert abs(r["ratios"]["activations"] - 1) < 0.01, (r["rank"], r["ratios"])
    p = 4
    planted = lambda schedule, pp, m, r: tuple(  # noqa: E731 - every split pass at the steady count
        v_flight.Moment(c, True, p + 1, p) for c in (0, 1))
    from paralayer.resolve.memory import activations as memory_activations

    monkeypatch.setattr(memory_activations.v_flight, "moments", planted)
    # the plant is the plan's side (this process): the same measured rank, judged against it again
    last = R.driver.beside_the_plan(R.rehearsal_config(cfg, plan)[0], plan, ranks[1])
    assert last["ratios"]["activations"] < 0.95, last["ratios"]


def test_moments_do_not_change_past_the_cap():
    """moments() caps m at 2p + 2 (the steady round repeats): the uncapped walk gives the same
    counts for every m up to 8p, every rank, p = 2..10."""
    from collections import defaultdict

    def uncapped(schedule, p, m, r):
        held, seen = [0, 0], defaultdict(set)
        for kind, c in v_flight.v_order(schedule, p, m, r):
            if kind == "F":
                held[c] += 1
                continue
            seen[(c, kind != "B")].add(tuple(held))
            if kind in ("B", "W"):
                held[c] -= 1
        return {k: {(a, b) for a, b in v if not any(x >= a and y >= b and (x, y) != (a, b) for x, y in v)}
                for k, v in seen.items()}

    for schedule in ("zbv", "dualpipev"):
        for p in range(2, 11):
            for m in range(2 * p if schedule == "dualpipev" else p, 8 * p + 1, 3):
                for r in range(p):
                    got: dict = {}
                    for mo in v_flight.moments(schedule, p, m, r):
                        got.setdefault((mo.chunk, mo.split), set()).add((mo.held0, mo.held1))
                    assert got == uncapped(schedule, p, m, r), (schedule, p, m, r)
