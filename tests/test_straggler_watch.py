"""The straggler watch's decision on gathered tables (paralayer/metrics/rank_timing.py), no ranks
started: a one-rank run names nobody (it warned "rank 0 kept the other ranks waiting 0.000 s"), a
rank the others waited for is named after the streak, and where nobody waited the busy-time rule speaks."""
from __future__ import annotations

from paralayer.metrics import waited_for
from paralayer.metrics.rank_timing import STREAK, StragglerWatch


def _row(compute: float, owed: dict[int, float]) -> list[float]:
    return [compute, 0.1, 0.0, 0.0] + waited_for.row(owed)


def _warnings(tables: list[list[list[float]]], hosts: list[str]) -> list[str]:
    said: list[str] = []
    watch = StragglerWatch(20.0, hosts, printer=said.append)
    for step, table in enumerate(tables, 1):
        watch.fields(table, step)
    return said


def test_one_rank_is_never_a_straggler():
    assert _warnings([[_row(1.8, {})]] * (STREAK + 2), ["vm"]) == []


def test_nobody_waited_falls_back_to_busy_time():
    """No wait recorded (no blocking collective matched): the busy-time rule, said as such."""
    assert _warnings([[_row(1.0, {}), _row(1.1, {})]] * (STREAK + 2), ["a", "b"]) == []
    said = _warnings([[_row(1.0, {}), _row(3.0, {})]] * STREAK, ["a", "b"])
    assert len(said) == 1 and "rank 1 (host b) is " in said[0] and "slower than the median rank" in said[0], said


def test_the_rank_waited_for_is_named_after_the_streak():
    table = [_row(1.0, {1: 0.8}), _row(1.0, {})]  # rank 0 waited 0.8 s on rank 1
    said = _warnings([table] * STREAK, ["a", "b"])
    assert len(said) == 1 and said[0].startswith("paralayer: straggler: rank 1 (host b) kept the other ranks "
                                                 "waiting 0.800 s"), said
    assert _warnings([table] * (STREAK - 1), ["a", "b"]) == []
