"""QK-clip under every layout equals one process's (issue #47 item 5).

``train()`` with ``train.optimizer=muon`` and a τ low enough that heads are clipped at init std 0.2,
3 steps (the rescales after steps 1 and 2 shape steps 2 and 3): loss, grad norm and the step's max
logit within 1e-5 (relative) of one rank, and the same heads clipped (counted). The cases of one
world size train in turn in ONE forked world. The layouts reach each way the maxima and the
rescale meet the parallelism: replicas that must all scale alike (dp2, ZeRO-1's whole-parameter shares), FSDP2 row
shards each rank scales its rows of (ZeRO-2, whose gathered weights must not outlive the step;
ZeRO-3), tp's heads measured where they live and reduced over tp (tp2; with ZeRO-3 the rows are
strided shards: dp2·tp2), stages apart (pp2), each context rank's
zigzag queries against the gathered keys (cp2), and MLA (DeepSeek-V3 / Kimi K2's attention: q_b and
kv_b split by heads under tp2; its ring under cp2), and DeepSeek-V3's tiny block (MLA, MoE under ep2,
the MTP block's attention clipped too). Plants fail: maxima left unreduced over dp·cp
(the data ranks clip differently), and under cp each rank's chunks measured alone (keys not gathered).
"""
from __future__ import annotations

import functools

import pytest

from tests.dist import TINY_SMALL, cfg_and_plan, paired, worlds_by_size

STEPS, TOL = 3, 1e-5
KEYS = ("loss", "grad_norm", "max_logit")
#: a global batch of 4 (TINY_SMALL's 8 halved: two micro-batches of 2 on one rank, one per data rank)
DENSE = TINY_SMALL + ["train.global_batch=4", "train.optimizer=muon", f"train.steps={STEPS}", "train.threads=1",
                      "logging.progress=false",
                      "checkpoint.every=0", "train.lr=1e-2", "train.muon.qk_clip_tau=20"]
MLA = DENSE + ["model.n_kv_heads=4", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=16",
               "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
               "train.muon.qk_clip_tau=5"]
#: DeepSeek-V3's block at laptop size: MLA with a q LoRA and YaRN, MoE, and an MTP block (whose
#: attention clips too): 5 attentions of 4 heads
DSV3 = [x for x in DENSE if not x.startswith(("recipe=", "model.n_layers", "model.seq_len", "train.muon.qk"))] + [
    "recipe=deepseek-v3-tiny", "train.muon.qk_clip_tau=5"]
LAYOUTS = {
    "dp2": (DENSE, ["parallel.dp=2"]),
    "dp2 zero1": (DENSE, ["parallel.dp=2", "parallel.zero=1"]),
    "dp2 zero2": (DENSE, ["parallel.dp=2", "parallel.zero=2"]),
    "dp2 zero3": (DENSE, ["parallel.dp=2", "parallel.zero=3"]),
    "tp2": (DENSE, ["parallel.dp=1", "parallel.tp=2"]),
    "pp2": (DENSE, ["parallel.dp=1", "parallel.pp=2"]),
    "dp2 tp2 zero3": (DENSE, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]),
    "mla dp2 zero3": (MLA, ["parallel.dp=2", "parallel.zero=3"]),
    "mla tp2": (MLA, ["parallel.dp=1", "parallel.tp=2"]),
    "cp2": (DENSE, ["parallel.dp=1", "parallel.cp=2"]),
    "mla cp2": (MLA, ["parallel.dp=1", "parallel.cp=2"]),
    "deepseek-v3-tiny dp2 ep2": (DSV3, ["parallel.dp=2", "parallel.ep=2"]),
}
ONE = {"dense": DENSE + ["parallel.dp=1"], "mla": MLA + ["parallel.dp=1"],
       "dsv3": DSV3 + ["parallel.dp=1", "parallel.ep=1"]}
HEADS = {"dense": 8, "mla": 8, "dsv3": 20}

import paralayer.runtime.train  # noqa: E402,F401  (imported once, before the ranks fork)
from paralayer.optim import qk_clip  # noqa: E402

_BUILD = qk_clip.build  # the real one: each case wraps it afresh (never a wrapper of the last case's plant)


def _train(overrides: list, plant: str) -> list:
    from paralayer.runtime.train import train

    def build(cfg, built, meshes):
        clip = _BUILD(cfg, built, meshes)
        if plant == "unreduced_over_dp":  # each data rank clips by its own sequences' maxima
            clip.groups = [g for g in clip.groups if g is not meshes["dp_cp"].get_group()]
        if plant == "cp_keys_not_gathered":  # each context rank's chunks alone, as if a whole sequence
            for m in clip.modules:
                m.max_logit.cp = None
        return clip

    qk_clip.build = build
    try:
        cfg, plan = cfg_and_plan(overrides)
        return [{k: r[k] for k in ("step", *KEYS, "qk_clipped_heads")} for r in train(cfg, plan)]
    finally:
        qk_clip.build = _BUILD


def _train_list(rank: int, world: int, jobs: list) -> list:
    """Every (overrides, plant) of ``jobs`` in turn in this world, each with its own plant (or none)."""
    return [_train(overrides, plant) for overrides, plant in jobs]


#: every case: the one-rank references, the layouts and the plants, by name
CASES = {**{f"one {k}": (ov, "") for k, ov in ONE.items()},
         **{name: (base + layout, "") for name, (base, layout) in LAYOUTS.items()},
         "plant unreduced_over_dp": (DENSE + ["parallel.dp=2"], "unreduced_over_dp"),
         "plant cp_keys_not_gathered": (DENSE + ["parallel.dp=1", "parallel.cp=2"], "cp_keys_not_gathered")}


@pytest.fixture(scope="module")
def runs() -> dict:
    """{case: rank 0's records}: the cases of one world size in turn in ONE forked world (3 worlds,
    not one per case), each computed the first time a test asks for its world."""
    return worlds_by_size(CASES, lambda case: _world(case[0]), _train_list, timeout_s=900)


@functools.lru_cache(maxsize=None)
def _world_of(overrides: tuple) -> int:
    return int(cfg_and_plan(list(overrides))[1]["world_size"])


def _world(overrides: list) -> int:
    """The plan's world size (resolved once per case: ~60 ms each)."""
    return _world_of(tuple(overrides))


@pytest.fixture(scope="module")
def reference(runs) -> dict:
    return {k: runs(f"one {k}") for k in ONE}


def max_err(got: list, want: list) -> float:
    return max(max(abs(a[k] - b[k]) / abs(b[k]) for k in KEYS) for a, b in paired(got, want))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process(name, runs, reference):
    base, layout = LAYOUTS[name]
    kind = {id(DENSE): "dense", id(MLA): "mla", id(DSV3): "dsv3"}[id(base)]
    got, want = runs(name), reference[kind]
    err = max_err(got, want)
    counts = [r["qk_clipped_heads"] for r in want]
    print(f"{name}: max rel err {err:.2e} over {STEPS} steps; heads clipped per step {counts} of {HEADS[kind]}")
    assert err <= TOL, (got, want)
    assert [r["qk_clipped_heads"] for r in got] == counts
    assert sum(counts) > 0 and min(counts) < HEADS[kind], counts  # it fired, and chose heads


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plant", ["unreduced_over_dp", "cp_keys_not_gathered"])
def test_planted_distribution_errors_fail(plant, runs, reference):
    got = runs(f"plant {plant}")
    err = max_err(got, reference["dense"])
    print(f"{plant}: max rel err {err:.2e}")
    assert err > 100 * TOL, (got, reference["dense"])
