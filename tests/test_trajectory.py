"""The tiny recipe's stored loss trajectory (issue #37): a change in numerics is a reviewed diff.

Every parity test compares one layout with another run of the same commit, so a change that moves
every layout the same way (the init, the loss reduction, the data order, the optimizer) passes them
all. tests/assets/trajectory_tiny.json holds the one-rank run's per-step loss and grad norm over 20
steps at init std 0.2 (the tiny recipe with seq 32 and a global batch of 8 to keep it cheap; lr 3e-4,
where 20 steps of Adam do not amplify fp32 rounding). Three layouts must reproduce it: one rank
(all 20 steps), tp2·dp2, and pp2 under the zbv (V) schedule with ZeRO-3 on dp 2 (their first
``LAYOUT_STEPS`` = 10 steps: train.stop_at_step, so the learning-rate schedule is still that of 20
steps; a 4-rank step costs ~4 one-rank steps of CPU). The runs of one world size train in turn in
ONE forked world.

Tolerances (relative, each step): loss 1e-6; grad norm 2e-6 (tp's sharded sums of squares leave
~1e-6 of rounding in the norm: measured at most 1.2e-6 for tp2·dp2 over 20 steps). The one-rank
run must match bit for bit on the machine that wrote the file.

When numerics change on purpose, regenerate with ``python -m tests.test_trajectory --write`` and
say why in the commit message.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.dist import cfg_and_plan, run_ranks, worlds_by_size

ASSET = Path(__file__).resolve().parent / "assets" / "trajectory_tiny.json"
LOSS_TOL, NORM_TOL = 1e-6, 2e-6
LAYOUT_STEPS = 10
BASE = ["recipe=tiny", "model.init_std=0.2", "model.seq_len=32", "train.steps=20", "train.global_batch=8",
        "train.micro_batch=2", "train.lr=3e-4", "train.threads=1", "logging.wandb.mode=disabled",
        "logging.progress=false", "checkpoint.every=0"]
LAYOUTS = {
    "one rank": ["parallel.tp=1", "parallel.dp=1"],
    "tp2 dp2": ["parallel.tp=2", "parallel.dp=2"],
    "pp2 zbv zero3 dp2": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv",
                          "parallel.dp=2", "parallel.zero=3"],
}

import paralayer.runtime.train  # noqa: E402,F401  (imported once, before the ranks fork)


def _train(overrides: list, planted: bool) -> list:
    import paralayer.runtime.build as build
    from paralayer.runtime.train import train

    real = build.lm_loss
    if planted:  # the planted bug: an off-by-one in the mean's denominator (sum / (n + 1))
        def off_by_one(logits, labels, vocab_size=None):
            n = (labels != -100).sum()
            return real(logits, labels, vocab_size) * n / (n + 1)

        build.lm_loss = off_by_one
    try:
        cfg, plan = cfg_and_plan(overrides)
        return [(r["step"], r["loss"], r["grad_norm"]) for r in train(cfg, plan)]
    finally:  # the next run of this world trains with the real loss
        build.lm_loss = real


def _train_list(rank: int, world: int, jobs: list) -> list:
    """Every (overrides, planted) of ``jobs`` in turn in this world."""
    return [_train(overrides, planted) for overrides, planted in jobs]


def _overrides(name: str, extra: tuple = ()) -> list:
    return BASE + LAYOUTS[name] + list(extra)


def _world(overrides: list) -> int:
    return int(cfg_and_plan(overrides)[1]["world_size"])


def run_layout(name: str, planted: bool = False, extra: tuple = ()) -> list:
    """[(step, loss, grad_norm)] of rank 0 of one layout."""
    ov = _overrides(name, extra)
    return run_ranks(_train_list, _world(ov), [(ov, planted)], timeout_s=300, pg_timeout_s=60)[0][0]


#: every run of the tests: (layout, planted, extra overrides)
RUNS = {"one rank": ("one rank", False, ()),
        **{name: (name, False, (f"train.stop_at_step={LAYOUT_STEPS}",)) for name in LAYOUTS if name != "one rank"},
        "planted": ("one rank", True, ("train.stop_at_step=3",))}


@pytest.fixture(scope="module")
def runs():
    """``runs(key)``: rank 0's records of RUNS[key]; the runs of one world size in turn in ONE forked
    world (one rank: the stored layout and the plant; 4 ranks: the other two layouts), each world
    the first time a test asks for one of its runs."""
    jobs = {k: (_overrides(n, extra), planted) for k, (n, planted, extra) in RUNS.items()}
    return worlds_by_size(jobs, lambda job: _world(job[0]), _train_list)


def mismatches(got: list, stored: dict) -> list[str]:
    """The steps where ``got`` leaves the stored trajectory (empty: it matches)."""
    want = stored["steps"]
    if [g[0] for g in got] != [w["step"] for w in want][:len(got)] or not got:
        return [f"steps {[g[0] for g in got]} against stored {[w['step'] for w in want]}"]
    bad = []
    for (step, loss, norm), w in zip(got, want):
        el = abs(loss - w["loss"]) / abs(w["loss"])
        en = abs(norm - w["grad_norm"]) / abs(w["grad_norm"])
        if el > LOSS_TOL or en > NORM_TOL:
            bad.append(f"step {step}: loss {loss!r} vs {w['loss']!r} ({el:.1e}), "
                       f"grad norm {norm!r} vs {w['grad_norm']!r} ({en:.1e})")
    return bad


@pytest.fixture(scope="module")
def stored() -> dict:
    data = json.loads(ASSET.read_text())
    assert len(data["steps"]) == 20 and data["overrides"] == BASE + LAYOUTS["one rank"]
    return data


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reproduces_the_stored_trajectory(name, stored, runs):
    got = runs(name)
    assert len(got) == (20 if name == "one rank" else LAYOUT_STEPS)
    bad = mismatches(got, stored)
    assert not bad, f"{name} left the stored trajectory ({ASSET.name}):\n" + "\n".join(bad)


@pytest.mark.timeout(600)
def test_a_planted_change_in_the_loss_reduction_fails(stored, runs):
    """The oracle can fail: sum / (n + 1) instead of the mean leaves the file from step 1."""
    got = runs("planted")
    assert len(got) == 3
    bad = mismatches(got, stored)
    assert len(bad) == 3 and bad[0].startswith("step 1:"), bad


def write() -> None:
    recs = run_layout("one rank")
    ASSET.parent.mkdir(exist_ok=True)
    ASSET.write_text(json.dumps({
        "what": "tiny recipe, one rank: per-step loss (before the update) and grad norm (before clipping)",
        "regenerate": "python -m tests.test_trajectory --write",
        "overrides": BASE + LAYOUTS["one rank"],
        "steps": [{"step": s, "loss": loss, "grad_norm": g} for s, loss, g in recs],
    }, indent=1) + "\n")
    print(f"wrote {ASSET} ({len(recs)} steps)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_trajectory --write")
    write()
