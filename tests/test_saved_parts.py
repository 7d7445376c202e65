"""The plan names the saved tensor that makes a layout too big (issue 45 item 2: DeepSeek-V3's
published layout without full recompute does not fit this runtime; the plan says which tensor).
resolve/memory/saved_parts.py splits a layer's saved set per token by tensor; the parts must sum to
the memory model's own total for every shipped recipe, kind, mode and precision, or they name the
wrong tensor."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from paralayer.config import load_config
from paralayer.resolve import rules
from paralayer.resolve.memory import activations as A
from paralayer.resolve.memory.saved_parts import act_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "recipes", "*.yaml"))
                 if not p.endswith("base.yaml"))
MODES = ("none", "selective", "swiglu", "core_attn", "norm_up", "full")


def _mismatches() -> list:
    bad, n = [], 0
    for recipe in RECIPES:
        for extra in ([], ["train.precision=fp32"], ["train.precision=fp8", "cluster=h100-80gb-8x"]):
            cfg = load_config([f"recipe={recipe}", *extra])
            lay = rules.check(cfg)
            if lay.errors:
                continue
            for kind in sorted({A.layer_kind(cfg, i) for i in range(cfg.model.n_layers)}):
                moe, linear = A.KINDS[kind]
                for mode in MODES:
                    want = A.act_elems_per_token(cfg, lay, moe, mode, linear)
                    got = sum(act_parts(cfg, lay, moe, mode, linear).values())
                    n += 1
                    if abs(got - want) > 1e-9 * max(abs(want), 1.0):
                        bad.append((recipe, extra, kind, mode, got, want))
    assert n > 300, n  # the sweep really ran
    return bad


def test_the_parts_sum_to_the_memory_models_total():
    assert _mismatches() == []


def test_a_part_left_out_fails(monkeypatch):
    real = A._act_elems

    def drop_routing(*args, parts=None, **kw):
        out = real(*args, parts=parts, **kw)
        if parts is not None:
            parts.pop("router and routing bookkeeping", None)
        return out

    monkeypatch.setattr("paralayer.resolve.memory.saved_parts._act_elems", drop_routing)
    assert any(b[2] in (1, 3) for b in _mismatches())  # every MoE kind misses it


def test_deepseek_v3_without_full_recompute_names_the_routed_rows():
    r = subprocess.run([sys.executable, "launch.py", "recipe=deepseek-v3", "train.precision=fp8",
                        "parallel.recompute=norm_up", "--dry-run", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-500:]
    plan = json.loads(r.stdout)
    top = plan["activations_by_tensor"]
    m = load_config(["recipe=deepseek-v3"]).model
    first = top["tensors"][0]
    # 3 d_model-wide bf16 copies of each of the top_k routed rows per token
    assert first["tensor"].startswith("routed rows' d_model-wide copies")
    assert first["bytes_per_token_per_layer"] == 3 * m.moe.top_k * m.d_model * 2
    assert top["layer_kind"] == "MoE" and top["recompute"] == "norm_up" and top["pp_rank"] == plan["memory_stage"]
    assert first["share"] == pytest.approx(first["bytes_per_token_per_layer"] / top["bytes_per_token_per_layer"])
    assert sum(t["bytes_per_token_per_layer"] for t in top["tensors"]) == pytest.approx(
        top["bytes_per_token_per_layer"], rel=1e-12)
    line = [x for x in r.stderr.splitlines() if x.startswith("error: memory:")]
    assert len(line) == 1 and "the largest tensor is routed rows' d_model-wide copies" in line[0], r.stderr[-800:]
    fits = subprocess.run([sys.executable, "launch.py", "recipe=deepseek-v3", "--dry-run", "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    assert fits.returncode == 0 and "activations_by_tensor" not in json.loads(fits.stdout)
