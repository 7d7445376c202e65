"""The plan against the rehearsal at two depths (issue 46 item 1): a per-layer term that is
missing, or one that appears only past two layers, shows as a ratio that moves with depth.

The rehearsal tests of the families (tests/test_rehearse_models.py) run two-layer copies in fp32;
qwen3-8b and qwen3-32b then agreed at 1.000 while their bf16 recipes at full depth rehearsed
5-7% over the plan (the q/k norms' fp32 outputs, one term per layer). Here each family runs in
its recipe's own precision (bf16 for the full-size recipes), recompute and kind of layout (tp,
pp, ep), at tiny widths so the cost stays small, at 2 and 4 layers (6 where the fourth layer is not yet
the recipe's other kind: gemma3's full layer is the sixth; qwen3-next's 3:1 pattern): states exact, activations
exact (1e-4; the MoE families within their measured bounds, TOLERANCE) at both depths,
and the per-layer increment of the measured activations is the plan's. The full recipes at their
own depth and layout are rows of ``benchmarks/rehearse_matrix.py --recipes`` (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import pytest

from paralayer import config as config_mod
from paralayer import rehearse as R
from paralayer.resolve import resolve

#: Tiny widths with Qwen3's shape: q = n_heads·head_dim (96) wider than d_model (64), GQA.
TINY_GQA = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=24", "model.ffn_hidden=128",
            "model.vocab_size=256", "model.seq_len=64", "train.global_batch=8", "train.micro_batch=2",
            "cluster.nodes=1", "cluster.devices_per_node=4"]
CASES = {
    # qk_norm, selective recompute, bf16 under autocast (ZeRO-1), tp2 with SP
    "qwen3-dense": ["recipe=qwen3-8b", "parallel.tp=2", "parallel.dp=2"] + TINY_GQA,
    # the same block under pp2 (1F1B): first and last stage
    "qwen3-pp2": ["recipe=qwen3-32b", "parallel.tp=2", "parallel.pp=2", "parallel.dp=1"] + TINY_GQA,
    # Llama 3.1's block (no qk_norm, head_dim = d_model / n_heads)
    "llama3.1": ["recipe=llama3.1-8b", "parallel.tp=2", "parallel.dp=2", "model.head_dim=null"] + TINY_GQA,
    # the MoE families at their tiny recipes (dp2 ep2; fp32 on a CPU cluster)
    "qwen3-moe": ["recipe=tiny-qwen3-moe"],
    "deepseek-v3-tiny": ["recipe=deepseek-v3-tiny"],
    # Qwen3-Next's hybrid: Gated DeltaNet layers (resolve/memory/linear_acts.py) and gated full
    # attention, 3:1, with the gated shared expert (dp2 ep2, fp32)
    "qwen3-next": ["recipe=tiny-qwen3-next"],
    # Gemma 3 (tp2 SP, fp32): sliding layers on their own RoPE table and the window mask, the full
    # layer (the sixth) on the global table; at 2 layers all sliding
    "gemma3": ["recipe=tiny-gemma3"],
}
#: the layer pattern at each depth where the recipe's own list has another length (3:1 kept)
PATTERNS = {"qwen3-next": {2: "[linear,full]", 6: "[linear,linear,linear,full,linear,full]"}}
#: measured, not exact (activations ratio at 2 / 6 layers, and the per-layer increment): tiny-qwen3-moe
#: 1.0013 / 1.0014, increment 1.0014; deepseek-v3-tiny 0.9925 / 0.9990, increment 1.0047 (CPU's math path
#: for MLA, docs/planner.md). Bounds just above them: a missing per-layer term of the size issue 46
#: found (5%) fails. tiny-gemma3 read 1.021 / 1.022, increment 1.023, until each windowed layer's SDPA
#: stopped converting the bool mask into its own float copy (one shared per chunk: model/attention.py
#: window_bias) and the plan counted the sliding layers' RoPE table (memory/chunk_tables.py): exact.
#: tiny-qwen3-next reads 1.0012 at 4 layers: the Gated DeltaNet layer's per-microbatch terms (its
#: chunk's causal mask, C² bytes) are not counted (linear_acts), 0.15% a layer at these widths.
TOLERANCE = {"qwen3-moe": 2e-3, "deepseek-v3-tiny": 1e-2, "qwen3-next": 5e-3}
#: FLOPs, every family within 1e-3. tiny-qwen3-next read 0.927 at 2 layers and 0.897 at 6 until the plan
#: counted a linear layer's own projections and delta rule (it counted attention's on every layer:
#: cost/linear_flops.py) and the counter its triangular solves and the depthwise conv's
#: backward per group (rehearse/flops.py); 1.0000 now (1.0008 before the shared expert's gate was counted)
FLOPS_TOLERANCE: dict[str, float] = {}
#: the two depths by case: 2 and 4 layers where every layer past the first two is of a kind the first two
#: hold (a per-layer term shows in the increment of 2 layers as of 4: the planted test below); 2 and 6
#: where the deeper one first holds a kind the shallow one lacks (gemma3's full sixth layer) or keeps
#: both kinds in the 3:1 pattern (qwen3-next)
DEPTHS = {name: (2, 6) if name in ("gemma3", "qwen3-next") else (2, 4) for name in CASES}
#: a missing per-layer term of the size issue 46 found (q/k norms' fp32 outputs: 5-7% of a layer)
PLANTED_SHARE = 0.05


def _rehearse(overrides: list[str], layers: int, pattern: str | None = None) -> tuple[list[dict], object, dict]:
    cfg = config_mod.load_config(overrides + [f"model.n_layers={layers}"]
                                 + ([f"model.layer_types={pattern}"] if pattern else []))
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    pp = plan["degrees"]["pp"]
    out = R.rehearse(cfg, plan, sorted({0, (pp - 1) * (plan["world_size"] // pp)}))
    assert out["ok"] and out["ranks"], out.get("errors")
    return out["ranks"], cfg, plan


def _increment_errors(by_depth: dict, depths: tuple) -> list[tuple[int, int, float]]:
    """(rank, measured increment, its ratio to the plan's) of the activations from the shallow
    depth to the deep one, per rehearsed rank."""
    out = []
    for a, b in zip(by_depth[depths[0]], by_depth[depths[1]]):
        got = b["memory_bytes"]["activations"] - a["memory_bytes"]["activations"]
        plan = b["plan_memory_bytes"]["activations"] - a["plan_memory_bytes"]["activations"]
        out.append((a["rank"], got, got / plan))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_holds_at_two_depths(name, monkeypatch):
    tol = TOLERANCE.get(name, 1e-4)
    depths = DEPTHS[name]
    runs = {n: _rehearse(CASES[name], n, PATTERNS.get(name, {}).get(n)) for n in depths}
    by_depth = {n: ranks for n, (ranks, _, _) in runs.items()}
    for n, ranks in by_depth.items():
        for r in ranks:
            for part in ("params", "grads", "optimizer"):
                assert r["memory_bytes"][part] == r["plan_memory_bytes"][part], (name, n, r["rank"], part)
            assert abs(r["ratios"]["activations"] - 1) < tol, (name, n, r["rank"], r["ratios"])
            assert abs(r["ratios"]["flops"] - 1) < FLOPS_TOLERANCE.get(name, 1e-3), (name, n, r["rank"], r["ratios"])
    # what each layer adds, measured and planned: a per-layer term missing from the plan shows here
    # even where a fixed term (the head, the logits) would hide it in the total
    for rank, got, ratio in _increment_errors(by_depth, depths):
        assert got > 0 and abs(ratio - 1) < tol, (name, rank, got, ratio)
    # planted (the same measured ranks judged again, nothing re-run): the plan short of a per-layer
    # term of 5% of a layer's saved set; the increment between the two depths must miss it
    from paralayer.resolve.memory import activations

    real = activations.act_elems_per_token
    monkeypatch.setattr(activations, "act_elems_per_token",
                        lambda *a, **k: (1 - PLANTED_SHARE) * real(*a, **k))
    planted = {n: [R.driver.beside_the_plan(R.rehearsal_config(cfg, plan)[0], plan, r) for r in ranks]
               for n, (ranks, cfg, plan) in runs.items()}
    missed = _increment_errors(planted, depths)
    print(f"{name} at {depths} layers: increment {[round(x[2], 5) for x in _increment_errors(by_depth, depths)]}, "
          f"planted {[round(x[2], 5) for x in missed]}")
    assert all(abs(ratio - 1) > tol for _, _, ratio in missed), (name, missed)



def test_gemma3_tables_and_mask_are_counted_per_chunk(monkeypatch):
    """tiny-gemma3 at 6 layers (5 sliding, 1 full) under pp2 1F1B: each stage keeps the RoPE tables
    its layers use (stage 0: the sliding layers' only; stage 1: both) and one window mask per
    microbatch in flight; exact on both stages. Planted: the plan as before (one table, no mask)
    falls short on both."""
    from paralayer.resolve.memory import activations

    ov = ["recipe=tiny-gemma3", "parallel.tp=1", "parallel.pp=2", "parallel.schedule=1f1b", "model.n_layers=6"]
    cfg = config_mod.load_config(ov)
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    out = R.rehearse(cfg, plan, [0, 1])
    assert out["ok"] and len(out["ranks"]) == 2, out.get("errors")
    for r in out["ranks"]:
        assert abs(r["ratios"]["activations"] - 1) < 1e-4, (r["rank"], r["ratios"])
    monkeypatch.setattr(activations, "chunk_tables", lambda cfg, lay, ids, last=False: (1, 0) if ids else (0, 0))
    for r in out["ranks"]:
        planted = R.driver.beside_the_plan(R.rehearsal_config(cfg, plan)[0], plan, r)
        print(f"rank {r['rank']}: activations {r['ratios']['activations']:.5f}, planted "
              f"{planted['ratios']['activations']:.5f}")
        assert planted["ratios"]["activations"] > 1.002, (r["rank"], planted["ratios"])
