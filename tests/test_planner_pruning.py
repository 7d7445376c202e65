"""The planner's pruning proven on every shipped recipe (issue 46 item 4).

``--plan --top N`` skips structures by a lower bound, leaves layouts untimed whose step without
traffic cannot reach the N-th best, and caps its work (MAX_STRUCTURES, MAX_CANDIDATES). Its
answer must be the first N rows of the uncapped search: every bound off (each structure walked,
each layout that fits timed) and no cap; only those N rows are materialised, so the reference
costs the walk, not 10^5 rows. Checked for every recipes/*.yaml with its own cluster and with each
GPU profile and the local one at the recipe's node count, MoE recipes included, except the pairs
in :data:`TOO_SLOW` (the uncapped walk over 2.5 s of CPU, measured on the shared 2-core machine)
and the recipes in :data:`NOT_MEASURED`; CI takes each recipe on its own cluster and on two of the
other profiles (:func:`_in_ci`), ``PARALAYER_PRUNING_ALL=1`` every pair. A lower bound that
counts the ep traffic three times (planted) must change the answer.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import time

import pytest

from paralayer.config import load_config
from paralayer.resolve import planner
from paralayer.resolve.planner import bounds, search

TOP = 10
PROFILES = (None, "a100-80gb-8x", "h100-80gb-8x", "h200-141gb-8x", "h800-80gb-8x", "local")
RECIPES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "recipes",
                                                                          "*.yaml")) if not p.endswith("base.yaml"))
GPUS = PROFILES[1:5]
#: pairs whose uncapped walk takes over 2.5 s of CPU here (left out of CI; the pruned plan of each
#: took at most 2.3 s): deepseek-moe-16b on 8 nodes of any GPU 8.2-10.3 s; deepseek-v3 on 256 h200
#: nodes 2.8 s, on 256 local nodes 10.7 s; gemma3-27b (64 nodes) 4.5-6.5 s on every profile;
#: gpt3-175b (128 nodes) 11-13.5 s on its own, a100, h100 (over 2.5 s on h200; h800, local not
#: measured); mixtral-8x7b and qwen3-32b (8 nodes) on every profile, qwen3-30b-a3b (4 nodes) on
#: every GPU profile: over 2.5 s; gpt-oss-120b (16 nodes, 128 experts) 38-53 s wall on its own and
#: every GPU profile, 9.4 s on local (6 Dec, the suite's two workers beside other work). The uncapped
#: walks that ran to the end agreed with the pruned top; qwen3-next-80b-a3b (16 nodes, 512 experts)
#: 20-21 s on its own, a100 and h200 (each agreed). 7 Dec, at load 0: qwen3.5-35b-a3b (8 nodes, Gated
#: DeltaNet) 8.0-8.1 s on its own, h100 and h800 (each agreed); deepseek-v3 since the balanced V 2.7 s on
#: its own, h100 and h800 (each agreed; its own stays, the planted test's pair).
TOO_SLOW = ({("deepseek-moe-16b", p) for p in (None, *GPUS)}
            | {("qwen3.5-35b-a3b", p) for p in PROFILES}
            | {("deepseek-v3", p) for p in GPUS}
            | {("gpt-oss-120b", p) for p in PROFILES} | {("qwen3-next-80b-a3b", p) for p in PROFILES}
            | {("deepseek-v3", "h200-141gb-8x"), ("deepseek-v3", "local")}
            | {("qwen3-30b-a3b", p) for p in (None, *GPUS)}
            | {(r, p) for r in ("gemma3-27b", "gpt3-175b", "mixtral-8x7b", "qwen3-32b") for p in PROFILES})
#: recipes of 32-256 nodes whose uncapped walk was not measured in this session (left out too)
NOT_MEASURED = ("kimi-k2", "llama3-405b", "llama3-70b", "qwen3-235b-a22b")
ALL_PAIRS = [(r, p) for r in RECIPES for p in PROFILES if (r, p) not in TOO_SLOW and r not in NOT_MEASURED]


def _in_ci(i: int, profile) -> bool:
    """CI's share (the suite's 20 minutes): each recipe on its own cluster and on two of the other
    five profiles, turning by the recipe's place, so every profile meets a third of the recipes;
    ``PARALAYER_PRUNING_ALL=1`` checks every pair above (~3x the time)."""
    if profile is None or os.environ.get("PARALAYER_PRUNING_ALL") == "1":
        return True
    k = PROFILES.index(profile) - 1
    return k in (i % 5, (i + 2) % 5)


PAIRS = [(r, p) for r, p in ALL_PAIRS if _in_ci(RECIPES.index(r), p)]


@functools.lru_cache(maxsize=None)
def config(recipe: str, profile) -> object:
    """The recipe on ``profile`` at the recipe's own node count (None: the recipe's own cluster);
    loaded once per pair and shared by the pruned and the uncapped search (the planner does not
    change its config), the recipe's own load once for all its profiles' node counts."""
    if profile is None:
        return load_config([f"recipe={recipe}"])
    nodes = config(recipe, None).cluster.nodes
    return load_config([f"recipe={recipe}", f"cluster={profile}", f"cluster.nodes={nodes}"])


#: the searches by the config's full text and n: a pair whose config is another's (a recipe on the
#: profile it names itself, at its own node count: 9 of CI's 58 pairs, e.g. llama3-8b-128k on
#: h100-80gb-8x, tiny on local) is the same search, walked once; each pair's case still asserts it
_PRUNED: dict = {}
_UNCAPPED: dict = {}


def pruned_top(recipe: str, profile, n: int) -> tuple[list[dict], dict, float]:
    """The pruned search's first ``n`` rows, its stats and its CPU seconds; kept (a few rows per
    pair) so the planted test's pair is not planned twice in one worker."""
    cfg = config(recipe, profile)
    key = (repr(cfg), n)
    if key not in _PRUNED:
        stats: dict = {}
        t0 = time.process_time()
        top = planner.plan_layouts(cfg, top=n, stats=stats)
        _PRUNED[key] = (top, stats, time.process_time() - t0)
    return _PRUNED[key]


def uncapped_top(recipe: str, profile, n: int) -> list[dict]:
    """The first ``n`` rows of the search with no bound and no cap (every layout that fits timed);
    kept (ten rows per pair) for the planted test and for a pair with the same config."""
    cfg = config(recipe, profile)
    key = (repr(cfg), n)
    if key not in _UNCAPPED:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(search, "structure_bound", lambda *a: -math.inf)
            m.setattr(search, "refined_bound", lambda *a: -math.inf)
            m.setattr(search, "slower_than", lambda *a: False)
            m.setattr(search, "MAX_STRUCTURES", 10 ** 12)
            m.setattr(search, "MAX_CANDIDATES", 10 ** 12)
            _UNCAPPED[key] = planner.plan_layouts(cfg, top=n)
    return _UNCAPPED[key]


@pytest.mark.parametrize("recipe, profile", PAIRS, ids=[f"{r}-{p or 'own'}" for r, p in PAIRS])
def test_pruned_top_is_the_uncapped_search(recipe, profile):
    top, stats, took = pruned_top(recipe, profile, TOP)
    t1 = time.process_time()
    ref = uncapped_top(recipe, profile, TOP)
    print(f"{recipe} on {profile or 'its cluster'}: pruned {took:.2f} s, uncapped {time.process_time() - t1:.2f} s "
          f"CPU; {len(ref)} rows, {stats['unexplored']} structures skipped, {stats['untimed']} layouts untimed")
    assert top == ref, (recipe, profile, [d["overrides"] for d in top], [d["overrides"] for d in ref])


def _inflated_ep(real, factor=10):
    def planted(pts, ax):
        fixed, per_m = real(pts, ax)
        # the bound reads the busiest rank's lines, keyed (rank, axis)
        return (factor * fixed, factor * per_m) if (ax[1] if isinstance(ax, tuple) else ax) == "ep" else (fixed, per_m)
    return planted


def test_planted_inflated_ep_bound_fails(monkeypatch):
    """The refined bound with the ep traffic counted thirty times is no lower bound: the pruned
    top differs from the uncapped search (deepseek-v3 on its 256 h800 nodes: its rows 9-10). Three
    times moved rows 7-10 until the step became the slowest rank's and parallel.pp_overlap's hidden
    all-to-alls left the bound (its top is now dualpipev and zbv at ep 8, inside a node). Since the
    balanced V (issue 45) the top holds pp 16 dualpipev rows at ep 16-64 whose all-to-alls hide
    behind pp_overlap: tenfold moved none, thirtyfold moves rows 6-10."""
    recipe = "deepseek-v3"
    cfg = config(recipe, None)
    ref = uncapped_top(recipe, None, TOP)
    assert pruned_top(recipe, None, TOP)[0] == ref  # the unplanted search agrees (its parametrized case)
    monkeypatch.setattr(bounds, "affine_line", _inflated_ep(bounds.affine_line, 30))
    bad = planner.plan_layouts(cfg, top=TOP)
    moved = [i + 1 for i, (a, b) in enumerate(zip(bad, ref)) if a["overrides"] != b["overrides"]]
    print(f"{recipe} planted thirtyfold ep bound: rows {moved} differ; best ep {bad[0]['degrees']['ep']} "
          f"vs {ref[0]['degrees']['ep']}")
    assert bad != ref and moved, recipe
