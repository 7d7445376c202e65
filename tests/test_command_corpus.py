"""The commands' generated corpus (tests/command_corpus.py) holds on a sample, and its checker can
fail: each kind of finding, planted in a forked child, is reported."""
from __future__ import annotations

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import command_corpus as corpus  # noqa: E402

from paralayer import cli  # noqa: E402


def test_a_sample_of_the_commands_corpus_holds(tmp_path):
    """7 cases, one of each kind (python tests/front_door_corpus.py --commands runs hundreds): 0
    crashes, time-outs, unnamed, multi-line, secrets, losses."""
    import torch  # noqa: F401 - shared by the forked children, as corpus.main does

    from paralayer.data import prepare  # noqa: F401
    from paralayer.metrics import report  # noqa: F401

    bad = []
    for i, case in enumerate(corpus.cases(7, seed=35)):
        d = tmp_path / str(i)
        d.mkdir()
        res = corpus.run_case(case, str(d))
        if res["problems"]:
            bad.append((res["kind"], res["problems"], res["argv"], res["err"][-200:]))
    assert not bad, bad


def _planted(what):
    def main(argv):
        t = argv[1]
        if what == "secret":
            print(f"error: INPUT: {os.environ['WANDB_API_KEY']}", file=sys.stderr)
            return 2
        if what == "written":
            open(os.path.join(t, "out.txt"), "w").write(os.environ["WANDB_API_KEY"])
            return 0
        if what == "lost":
            open(os.path.join(t, "in.txt"), "a").write("x")
            return 0
        if what == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if what == "traceback":
            raise ValueError("boom")
        if what == "two-lines":
            print("error: INPUT: a\nb", file=sys.stderr)
            return 2
        if what == "unnamed":
            print("error: something went wrong", file=sys.stderr)
            return 2
        if what == "exit1":
            return 1
        if what == "hang":
            import time

            time.sleep(30)
        return 0
    return main


@pytest.mark.parametrize("what,finding", [
    ("secret", "secret echoed"), ("written", "secret written"), ("lost", "lost: in.txt changed"),
    ("segv", "crash: signal 11"), ("traceback", "crash"), ("two-lines", "multi-line"), ("unnamed", "unnamed"),
    ("exit1", "crash: exit 1"), ("hang", "time-out")])
def test_the_checker_reports_a_planted_finding(tmp_path, monkeypatch, what, finding):
    monkeypatch.setattr(cli, "main", _planted(what))
    if what == "hang":
        monkeypatch.setattr(corpus, "WALL_S", 1.0)
    case = corpus.Case("planted", ["prepare", "{t}"], files={"in.txt": "doc\n"})
    res = corpus.run_case(case, str(tmp_path))
    assert any(p.startswith(finding) for p in res["problems"]), res
