"""Blends: Tijdeman's draws (every source within 1 − 1/(2S−2) sequences of its share after every
draw; the plain largest-deficit rule does not hold it), per-source counts in metrics.jsonl, a source that runs out wraps with a warning naming it,
and train() resumed mid-epoch and across an epoch boundary equals the straight run bit for bit."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from paralayer.config import DataConfig, load_config
from paralayer.data.blend import _Schedule
from paralayer.data.dataset import build_dataset
from paralayer.resolve.plan import resolve
from tests.dist import run_ranks
from tests.megatron_oracle import megatron

SEQ = 16


def _shard(prefix: str, n_tokens: int, lo: int, hi: int, seed: int) -> None:
    """A megatron-written shard of ids in [lo, hi), so a sequence's ids tell its source."""
    IndexedDatasetBuilder = megatron("IndexedDatasetBuilder")
    g = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    left = n_tokens
    while left:
        k = min(left, int(g.integers(5, 40)))
        b.add_item(torch.tensor(g.integers(lo, hi, size=k)))
        b.end_document()
        left -= k
    b.finalize(prefix + ".idx")


def _sources(tmp) -> list:
    """Three sources of 10, 30 and 20 sequences (ids 0-19, 20-39, 40-63)."""
    out = []
    for i, (n_seq, lo, hi) in enumerate([(10, 0, 20), (30, 20, 40), (20, 40, 64)]):
        p = os.path.join(tmp, f"src{i}")
        _shard(p, n_seq * SEQ + 3, lo, hi, i)
        out.append(p)
    return out


#: a vector that separates the rules (issue #37): the plain largest-deficit rule drifts to 1.067
#: sequences from a share (position 15), Tijdeman's stays within 0.867 <= 1 - 1/(2·5-2) = 0.875
SEPARATING = [1, 1, 1, 21, 21]
POSITIONS = list(range(1, 400)) + [10_000, 20_001]


class _PlainDeficit:
    """A planted copy of the rule Tijdeman's replaced: draw t goes to the largest deficit
    ``w_s·t − c_s`` (ties to the first source), with no threshold and no deadline."""

    def __init__(self, weights):
        self.w = np.asarray(weights, float) / sum(weights)
        self.c, self.pos = np.zeros(len(self.w), dtype=np.int64), 0

    def counts_at(self, pos):
        for p in range(self.pos, pos):
            self.c[int(np.argmax(self.w * (p + 1) - self.c))] += 1
        self.pos = pos
        return self.c.tolist()


def _worst(schedule, weights) -> float:
    """The largest |c_s − w_s·pos| over POSITIONS (the counts must sum to pos)."""
    w = np.asarray(weights, float) / sum(weights)
    worst = 0.0
    for pos in POSITIONS:
        c = np.asarray(schedule.counts_at(pos))
        assert c.sum() == pos
        worst = max(worst, float(np.abs(c - w * pos).max()))
    return worst


def _bound(weights) -> float:
    return 1.0 - 1.0 / (2 * len(weights) - 2) + 1e-9  # Tijdeman: 1 − δ, δ = 1/(2S − 2)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1, 1], [7, 0.01, 2.5], [1e-3, 1.0], SEPARATING])
def test_every_source_within_one_minus_delta_of_its_share(weights):
    s = _Schedule(weights)
    assert _worst(s, weights) <= _bound(weights)
    # replayed cold (a resumed process) it gives the same counts
    assert _Schedule(weights).counts_at(20_001) == s.counts_at(20_001)


def test_the_plain_largest_deficit_rule_fails_the_bound():
    """The oracle separates the rules: the planted old rule passes the gentle vectors and breaks
    even the one-sequence bound on SEPARATING."""
    assert _worst(_PlainDeficit([0.5, 0.3, 0.2]), [0.5, 0.3, 0.2]) <= _bound([0.5, 0.3, 0.2])
    worst = _worst(_PlainDeficit(SEPARATING), SEPARATING)
    assert worst > 1.0 > _bound(SEPARATING), worst
    assert abs(worst - 1.0667) < 1e-3 and abs(_worst(_Schedule(SEPARATING), SEPARATING) - 0.8667) < 1e-3


class _Counting(_Schedule):
    """The schedule, counting its draws (a replay from 0 to position P draws P times)."""
    draws = 0

    def _pick(self, t):
        self.draws += 1
        return super()._pick(t)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], SEPARATING, [7, 0.01, 2.5]])
def test_a_resume_from_the_stored_counts_equals_the_replay_without_replaying(weights):
    for pos in (0, 1, 999, 12_345, 100_003):
        before = _Schedule(weights)
        before.counts_at(pos)  # the run that saved its checkpoint at ``pos``
        state = before.state_dict()
        resumed, replay = _Counting(weights), _Counting(weights)
        assert resumed.load_state_dict(state)
        a, b = resumed.assign(pos, 64), replay.assign(pos, 64)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        assert resumed.counts_at(pos + 64) == replay.counts_at(pos + 64)
        assert resumed.draws == 64 and replay.draws == pos + 64  # O(batch), not O(position)
        assert resumed.counts_at(pos // 2) == _Schedule(weights).counts_at(pos // 2)  # before it: replays


def test_a_stored_state_of_another_blend_is_not_taken():
    s = _Schedule([0.5, 0.3, 0.2])
    s.counts_at(100)
    state = s.state_dict()
    assert not _Schedule([0.5, 0.2, 0.3]).load_state_dict(state)  # other weights
    assert not _Schedule([0.5, 0.3, 0.2]).load_state_dict(dict(state, pos=101))  # counts do not sum to pos
    assert not _Schedule([0.5, 0.3, 0.2]).load_state_dict(None)
    fresh = _Schedule([0.5, 0.3, 0.2])
    assert not fresh.load_state_dict(dict(state, counts=[100, 0]))
    assert fresh.counts_at(100) == state["counts"]  # it replays instead


def test_blend_batches_counts_and_wrap_warning(tmp_path, capsys):
    src = _sources(str(tmp_path))
    blend = [{"path": p, "weight": w} for p, w in zip(src, [0.5, 0.3, 0.2])]
    cfg = DataConfig(format="indexed", shuffle=True, blend=blend)
    ds = build_dataset(cfg, SEQ, 3, str(tmp_path / "c"), global_batch=8, vocab_size=64)
    assert ds.n_sequences == 60
    owner = lambda x: int(x[0] >= 20) + int(x[0] >= 40)  # noqa: E731 - the source a row came from
    seen = [[], [], []]
    for k in range(1, 7):
        b = ds.get_batch(k)
        counts = ds.source_sequences(k)
        assert sum(counts.values()) == 8 * k
        for row in b.numpy():
            seen[owner(row)].append(tuple(row))
        assert [len(x) for x in seen] == [counts[p] for p in src]
        for s, w in enumerate([0.5, 0.3, 0.2]):
            assert abs(counts[src[s]] - w * 8 * k) < 1.0
    # source 0 (10 sequences) gave 24: two full epochs of distinct sequences, then wrapped, named
    assert len(set(seen[0][:10])) == 10 and set(seen[0][:10]) == set(seen[0][10:20])
    err = capsys.readouterr().err
    assert f"data.blend source {src[0]} ran out of its 10 sequences; wrapping into epoch 2" in err
    # dp shares of a blended batch are the global batch
    full = ds.get_batch(5)
    assert torch.equal(torch.cat([ds.get_batch(5, r, 4) for r in range(4)]), full)


# ------------------------------------------------------------------ resume through train()
BASE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=48",
        "model.vocab_size=64", f"model.seq_len={SEQ}", "train.global_batch=8", "train.micro_batch=4",
        "train.steps=5", "train.lr=3e-3", "train.warmup_steps=1", "train.precision=fp32", "train.threads=1",
        "data.format=indexed", "data.shuffle=true", "logging.wandb.mode=disabled", "logging.progress=false",
        "checkpoint.keep=2", "parallel.dp=1", "model.init_std=0.2"]


def _rank_train(rank, world, cfg, plan, run_dir):
    from paralayer.runtime.train import train
    recs = train(cfg, plan, run_dir)
    return [{k: r[k] for k in ("step", "loss", "grad_norm", "lr", "source_sequences")} for r in recs]


def _rank_train_counted(rank, world, cfg, plan, run_dir, plant_never_loaded=False):
    """train(), counting the blend schedule's draws in this rank: (records, draws, positions loaded).
    ``plant_never_loaded``: the stored state is dropped as restore_extra reads it (the planted bug
    of issue 46), so the schedule replays from position 0."""
    from paralayer.data import blend as blend_mod

    seen = {"draws": 0, "loaded": []}
    pick, load = blend_mod._Schedule._pick, blend_mod.BlendedDataset.load_state_dict

    def counted(self, t):
        seen["draws"] += 1
        return pick(self, t)

    def loaded(self, state):
        if plant_never_loaded:
            return False
        took = load(self, state)
        seen["loaded"].append(self._schedule.pos if took else None)
        return took

    blend_mod._Schedule._pick, blend_mod.BlendedDataset.load_state_dict = counted, loaded
    try:
        recs = _rank_train(rank, world, cfg, plan, run_dir)
    finally:
        blend_mod._Schedule._pick, blend_mod.BlendedDataset.load_state_dict = pick, load
    return recs, seen["draws"], seen["loaded"]


def _run(tmp, name, blend, extra, fn=_rank_train, *fn_args):
    run_dir = os.path.join(tmp, name)
    cfg = load_config(BASE + [f"data.blend={blend}", f"checkpoint.dir={os.path.join(tmp, 'ckpt-' + name[:2])}",
                              f"run.dir={run_dir}", f"data.cache_dir={tmp}/cache"] + extra)
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    return run_ranks(fn, plan["world_size"], cfg, plan, run_dir, *fn_args, timeout_s=300)[0], run_dir, plan


def test_blend_resume_is_bit_identical(tmp_path):
    """Source 0 (10 sequences, weight 0.5) gives 4 sequences a step: the stop at step 2 falls
    mid-epoch (8 of 10) and the resumed steps cross into its second epoch (at 10)."""
    tmp = str(tmp_path)
    src = _sources(tmp)
    blend = "[" + ",".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(src, [0.5, 0.3, 0.2])) + "]"
    straight, run_dir, plan = _run(tmp, "s1-straight", blend, ["checkpoint.every=0"])
    first, _, _ = _run(tmp, "r1-first", blend, ["train.stop_at_step=2", "checkpoint.every=2"])
    # the planted "never loaded" (it writes no checkpoint): the same resume replays from 0, so the
    # oracle below can fail while the losses and counts, equal either way, cannot tell
    (planted, draws, loaded), _, _ = _run(tmp, "r1-planted", blend, ["train.resume=auto", "checkpoint.every=0"],
                                          _rank_train_counted, True)
    assert loaded == [] and draws == 5 * 8 and first + planted == straight
    (second, draws, loaded), _, _ = _run(tmp, "r1-second", blend, ["train.resume=auto", "checkpoint.every=2"],
                                         _rank_train_counted)
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5] and [r["step"] for r in second] == [3, 4, 5]
    # the stored state was loaded through train() (position 16 = 2 steps of 8) and used: the resumed run
    # drew its own 3 steps' 24 positions, not the 16 before them again (a replay from 0 draws 40)
    assert loaded == [16] and draws == 3 * 8, (loaded, draws)
    assert first + second == straight  # bitwise: loss, grad norm, lr, source counts
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [ln["source_sequences"][src[0]] for ln in lines] == [4, 8, 12, 16, 20]
    assert all(sum(ln["source_sequences"].values()) == 8 * ln["step"] for ln in lines)
    import glob
    extras = [torch.load(f) for f in glob.glob(os.path.join(tmp, "ckpt-r1", "**", "extra-rank00000.pt"), recursive=True)]
    assert extras  # each checkpoint holds the schedule's counts at its step (a resume takes them: no replay)
    for extra in extras:
        state = extra["data"]["blend_schedule"]
        assert state["pos"] == 8 * extra["step"] and state["counts"] == _Schedule([0.5, 0.3, 0.2]).counts_at(state["pos"])
    assert [s["tokens"] for s in plan["data"]["sources"]] == [10 * SEQ + 3, 30 * SEQ + 3, 20 * SEQ + 3]
    assert plan["data"]["sources"][0]["epochs"] == pytest.approx(2.0)
