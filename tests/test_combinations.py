"""Every pair of layout features, trained and compared with one process (issue #25).

tests/combos.py generates a pairwise covering array over the features the planner searches
(schedules, ZeRO, recompute, tp/SP/tp_overlap, cp, ep with both routers, capacity and routing by
group, the model families' attention (Qwen3, windows, DeepSeek's latent attention), MTP, tied
embeddings, uneven pp_layout, micro-batch); a pair counts only where both values take effect
(recompute_every under recompute=full, pp_layout with a pipeline, ep with experts). Each row trains
2 steps at init std 0.2 on at most ``combos.MAX_WORLD`` = 4 gloo ranks; its loss and grad norm must equal the one-rank run of the same model and batch every
step (1e-5 / 3e-5 relative). The rows of one world size run one after another inside ONE forked
world, and each one-rank reference is computed once. Pairs that cannot run together must be
refused by the resolver, naming the field; the planner must offer nothing outside the array.
"""
from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest
import torch

from tests import combos as C
from tests.dist import max_rel_err, run_ranks, write_tokens

LOSS_TOL, NORM_TOL = 1e-5, 3e-5

# Building a model on meta imports torch's reference ops, and train() DTensor, FSDP and the
# pipelining package (seconds of CPU per rank): import them once, before the ranks fork.
import paralayer.runtime.train  # noqa: E402,F401
from paralayer.config import ModelConfig  # noqa: E402
from paralayer.model.transformer import Transformer  # noqa: E402

# one thread in the test process too (its ranks take one each): the recompute check's 48 models ran
# 2 OpenMP threads on a loaded 2-core machine (CI's workers: the other files already set it)
torch.set_num_threads(1)
with torch.device("meta"):
    Transformer(ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=8, vocab_size=8))


@pytest.fixture(scope="module")
def rows():
    return C.suite_rows()


# ------------------------------------------------------------------ torch-free: the array itself
def test_array_covers_every_allowed_pair_on_at_most_4_ranks(rows):
    feats = C.feature_values()
    want = C.allowed_pairs(feats)
    got = set().union(*(C.row_pairs(r, feats) for r in rows))
    assert want - got == set()
    assert all(C.disallowed(f, a, g, b) is None for r in rows for (f, a), (g, b) in C.all_pairs(r, feats))
    assert max(C.world_size(r) for r in rows) <= C.MAX_WORLD == 4
    print(f"{len(rows)} layouts cover {len(want)} pairs; ranks {sorted(C.world_size(r) for r in rows)}")


def test_recompute_every_2_trains_under_every_schedule(rows):
    pipes = {r["pipe"] for r in rows if r["recompute"] == "full" and r["recompute_every"] == 2}
    assert pipes == set(C.feature_values()["pipe"]), pipes


def test_inert_pairs_do_not_count():
    feats = C.feature_values()
    row = dict(C.default_row(), recompute="none", recompute_every=2, pipe="gpipe", moe="dense")
    got = C.row_pairs(row, feats)
    assert (("pipe", "gpipe"), ("recompute_every", 2)) not in got
    assert not any("ep" in (p[0][0], p[1][0]) for p in got)  # ep without experts
    assert (("pipe", "gpipe"), ("recompute_every", 2)) in C.row_pairs(dict(row, recompute="full"), feats)
    assert not any("pp_layout" in (p[0][0], p[1][0]) for p in C.row_pairs(dict(row, pipe="none"), feats))
    want = C.allowed_pairs(feats)
    assert (("recompute", "none"), ("recompute_every", 2)) not in want  # never effective: not required
    assert (("recompute", "full"), ("recompute_every", 2)) in want


def test_the_old_count_misses_effective_pairs(monkeypatch):
    """A planted copy of the old count (every pair counts, effective or not): its array leaves
    recompute_every=2 untrained under most schedules, and the effective count sees it."""
    feats = C.feature_values()
    monkeypatch.setattr(C, "inert", lambda row: set())
    old = C.covering_array()
    monkeypatch.undo()
    missing = C.allowed_pairs(feats) - set().union(*(C.row_pairs(r, feats) for r in old))
    every2 = {b for (f, a), (g, b) in missing if f == "pipe" and g == "recompute_every" and b == 2}
    assert every2 and len(missing) >= 10, missing


#: model/recompute.py's region functions -> the names of combos.recomputed_regions
REGION_OF = {"_swiglu": "swiglu", "_core": "core", "_forward": "block"}


def _reruns(row: dict) -> list:
    """The regions one backward of the row's model (one rank, its recompute mode) reruns, in order."""
    from paralayer.config import load_config
    from paralayer.model import recompute as rc
    from paralayer.model.transformer import init_weights, lm_loss
    from paralayer.runtime.build import apply_recompute

    cfg = load_config(C.BASE + C.model_overrides(row) + [
        f"parallel.recompute={row['recompute']}", f"parallel.recompute_every={row['recompute_every']}",
        "parallel.dp=1"])
    model = Transformer(cfg.model)
    init_weights(model, cfg.model, seed=0)
    apply_recompute(model, row["recompute"], row["recompute_every"])
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    loss = lm_loss(model(tokens), tokens, cfg.model.vocab_size)
    if model.mtp is not None:
        loss = loss + sum(lm_loss(lg, t, cfg.model.vocab_size) for lg, t in model.mtp_outputs(tokens))
    seen, real = [], rc._Frame._rerun
    rc._Frame._rerun = lambda self: (seen.append(REGION_OF.get(self.fn.__name__, self.fn.__name__)), real(self))[1]
    try:
        loss.backward()
    finally:
        rc._Frame._rerun = real
    return seen


def test_every_rows_recompute_reruns_what_the_count_says(rows):
    """The pair count's premise, measured: in every row the recompute mode reruns exactly the
    regions combos.recomputed_regions names, and swiglu reruns at least one SwiGLU in every block
    (issue 46: in MoE blocks it reran none, yet its pairs with 1F1B, dualpipev, tp_overlap, ZeRO-2,
    tied embeddings and windows counted as covered)."""
    for row in rows:
        seen = _reruns(row)
        assert set(seen) == C.recomputed_regions(row), (row, sorted(set(seen)))
        if row["recompute"] == "swiglu":
            assert seen.count("swiglu") >= C.n_layers(row) + row.get("mtp", 0), (row, seen)


def test_generator_knows_every_planner_and_schema_knob():
    """A new knob must join the generator: every field of the schema's parallel section and every
    key of a planner layout is either a feature (or derived) or a known prediction."""
    import dataclasses

    from paralayer.config import load_config
    from paralayer.config.schema import ParallelConfig
    from paralayer.resolve.planner import plan_layouts

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert fields == set(C.PARALLEL_FIELDS), fields ^ set(C.PARALLEL_FIELDS)
    feats = C.feature_values()
    assert {v for v in C.PARALLEL_FIELDS.values() if v} <= set(feats)
    cfg = load_config(["recipe=tiny", "cluster=local", "cluster.devices_per_node=8"])
    lays = plan_layouts(cfg, top=5)
    assert lays
    for lay in lays:
        unknown = set(lay) - C.PLANNER_LAYOUT_KEYS - C.PLANNER_PREDICTION_KEYS
        assert not unknown, f"planner layout keys the combination generator does not know: {unknown}"
        assert set(lay["degrees"]) == {"tp", "pp", "vpp", "cp", "ep", "dp"}


def test_generator_knows_every_model_key():
    """A new key of the schema's model section must join the generator (issue #33): each one is
    varied by a feature (the family's parts, tied, moe) or named as fixed by the base model."""
    import dataclasses

    from paralayer.config.schema import ModelConfig

    def flat(cls, prefix=""):
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if sub is not None and dataclasses.is_dataclass(sub):
                yield from flat(sub, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    keys = set(flat(ModelConfig))
    assert keys == set(C.MODEL_FIELDS), keys ^ set(C.MODEL_FIELDS)
    assert {v for v in C.MODEL_FIELDS.values() if v} <= set(C.feature_values())
    assert set(C.FAMILY) == set(C.feature_values()["family"])


def _refused(row: dict, extra: list = ()) -> list:
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    cfg = load_config(C.BASE + C.overrides(row) + list(extra))
    return resolve(cfg).to_dict()["errors"]


def test_disallowed_pairs_are_refused_by_the_resolver():
    feats = C.feature_values()
    names = list(feats)
    refused = []
    for i, f in enumerate(names):
        for g in names[i + 1:]:
            for a in feats[f]:
                for b in feats[g]:
                    fld = C.disallowed(f, a, g, b)
                    if fld is None:
                        continue
                    row = dict(C.default_row(), **{f: a, g: b})
                    errs = _refused(row)
                    assert any(e["field"] == fld for e in errs), (f, a, g, b, errs)
                    refused.append((f, a, g, b))
    assert refused  # the constraints are real: each one is a refusal
    for extra, fld in C.REFUSED_SETTINGS:
        errs = _refused(C.default_row(), extra)
        assert any(e["field"] == fld for e in errs), (extra, errs)
    print("refused:", refused, [s for s, _ in C.REFUSED_SETTINGS])


def test_refused_rows_are_refused_and_not_in_the_array(rows):
    """A refusal of three values together (MTP, tied embeddings, a pipeline): the resolver names
    the field for every schedule, no row of the array holds it, and each of its pairs is still
    covered by rows that run."""
    feats = C.feature_values()
    for pipe in feats["pipe"][1:]:
        row = dict(C.default_row(), mtp=1, tied=True, pipe=pipe)
        fld = C.refused_row(row)
        assert fld == "model.mtp.depth"
        assert any(e["field"] == fld for e in _refused(row)), pipe
    assert C.refused_row(dict(C.default_row(), mtp=1, tied=True)) is None
    assert not [r for r in rows if C.refused_row(r)]
    covered = set().union(*(C.row_pairs(r, feats) for r in rows))
    assert (("tied", True), ("mtp", 1)) in covered
    assert all((("pipe", p), ("mtp", 1)) in covered for p in feats["pipe"])


def _planner_samples():
    from paralayer.config import load_config
    from paralayer.resolve.planner import plan_layouts

    cases = [["recipe=tiny", "cluster=local", "cluster.devices_per_node=8"],
             ["recipe=tiny", "cluster=local", "cluster.devices_per_node=8", "model.moe.num_experts=4",
              "model.moe.capacity_factor=1.25"],
             ["recipe=tiny", "cluster=local", "cluster.devices_per_node=8", "model.moe.num_experts=4",
              "model.moe.router=sigmoid", "model.tie_embeddings=true"],
             ["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.nodes=4"]]
    cases = [(ov, None) for ov in cases]
    tiny8 = ["recipe=tiny", "cluster=local", "cluster.devices_per_node=8", "model.n_layers=8"]
    cases += [(tiny8, {"pp": 2, "schedule": s}) for s in ("gpipe", "1f1b", "interleaved", "dualpipev")]
    # only full recompute on every k-th layer fits (tests/test_planner.py, recompute_every > 1)
    cases.append((["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=64", "model.seq_len=16384",
                   "train.global_batch=256", "cluster.device_memory_gib=70"],
                  dict(tp=8, pp=4, dp=16, cp=1, schedule="1f1b", zero=1, micro_batch=1, tp_overlap=False)))
    for ov, fixed in cases:
        cfg = load_config(ov)
        for lay in plan_layouts(cfg, top=60, fixed=fixed):
            yield ov, lay, C.planner_row(lay, cfg.model)


def test_planner_offers_nothing_outside_the_array(rows):
    """Invariant: every pair of feature values in a layout the planner offers was run by the suite
    (or would be refused: the planner must not offer those at all)."""
    feats = C.feature_values()
    covered = set().union(*(C.row_pairs(r, feats) for r in rows))
    n = 0
    for ov, lay, row in _planner_samples():
        n += 1
        assert set(row) == set(feats)
        for pair in C.row_pairs(row, feats):
            (f, a), (g, b) = pair
            assert pair in covered, (ov, lay["overrides"], pair)
        for (f, a), (g, b) in C.all_pairs(row, feats):
            assert C.disallowed(f, a, g, b) is None, (ov, lay["overrides"], (f, a), (g, b))
    assert n > 50


# ------------------------------------------------------------------ the runs
def _data(tmp) -> str:
    return write_tokens(os.path.join(str(tmp), "combos_tokens.jsonl"), 64, 16, 64, keep_existing=True)


def _resolved(overrides: list):
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    cfg = load_config(overrides)
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], (overrides, plan["errors"])
    return cfg, plan


def _run_list(rank, world, jobs):
    """Train every (cfg, plan) of ``jobs`` in turn in this world: [(loss, grad_norm) per step] each."""
    from paralayer.runtime.train import train

    return [[(r["loss"], r["grad_norm"]) for r in train(cfg, plan)] for cfg, plan in jobs]


@pytest.mark.timeout(1200)
def test_every_row_matches_one_rank(rows, tmp_path):
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    data = [f"data.path={_data(tmp_path)}"]
    keys = sorted({C.reference_key(r) for r in rows})
    ref_jobs = [_resolved(C.BASE + data + list(k) + ["parallel.tp=1", "parallel.dp=1"]) for k in keys]
    refs = dict(zip(keys, run_ranks(_run_list, 1, ref_jobs, timeout_s=300)[0]))
    t_ref = time.perf_counter() - t0
    by_world = defaultdict(list)
    for r in rows:
        by_world[C.world_size(r)].append(r)
    bad = []
    for world, group in sorted(by_world.items()):
        jobs = [_resolved(C.BASE + data + C.overrides(r)) for r in group]
        out = run_ranks(_run_list, world, jobs, timeout_s=600)
        for i, r in enumerate(group):
            ref = refs[C.reference_key(r)]
            for rank in range(world):
                recs = out[rank][i]
                el = max_rel_err([x[0] for x in recs], [x[0] for x in ref])
                en = max_rel_err([x[1] for x in recs], [x[1] for x in ref])
                if el > LOSS_TOL or en > NORM_TOL:
                    bad.append((C.overrides(r), rank, el, en))
                    break
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = cpu.ru_utime + cpu.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    print(f"{len(rows)} layouts, {len(keys)} references: {time.perf_counter() - t0:.1f} s wall "
          f"(references {t_ref:.1f} s), {cpu_s:.0f} CPU-s in the ranks")
    assert not bad, "\n".join(f"{ov} rank {rk}: loss {el:.2e} grad norm {en:.2e}" for ov, rk, el, en in bad)
