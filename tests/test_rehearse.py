"""--rehearse: the runtime's build and one step of chosen ranks at the full world, on fake tensors,
beside the plan's figures (tiny depth, real widths and world sizes: seconds per rank)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paralayer import config as config_mod
from paralayer import rehearse as R
from paralayer.resolve import resolve

BASE = ["recipe=llama3-8b", "cluster.nodes=8", "train.precision=fp32", "model.n_layers=2"]


def _rehearse(*overrides: str, ranks=None) -> dict:
    cfg = config_mod.load_config(list(overrides))
    plan = resolve(cfg).to_dict()
    return R.rehearse(cfg, plan, ranks)


def test_dense_tp8_dp8_at_64_ranks_agrees_with_the_plan():
    out = _rehearse(*BASE)
    assert out["ok"] and out["world_size"] == 64 and not out["errors"]
    (r,) = out["ranks"]
    assert r["coords"] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert r["memory_bytes"]["params"] == r["plan_memory_bytes"]["params"]
    assert r["memory_bytes"]["grads"] == r["plan_memory_bytes"]["grads"]
    assert r["memory_bytes"]["optimizer"] == r["plan_memory_bytes"]["optimizer"]  # ZeRO-1's deal, replayed
    assert abs(r["ratios"]["activations"] - 1) < 0.05
    assert abs(r["ratios"]["flops"] - 1) < 0.02
    assert abs(r["ratios"]["comm"]["dp"] - 1) < 0.05
    kinds = {(c["axis"], c["kind"]) for c in r["collectives"]}
    assert {("tp", "all-gather"), ("tp", "reduce-scatter"), ("dp", "all-reduce"), ("dp", "broadcast")} <= kinds
    # grad clipping and the loss: a constant number of scalar all-reduces, not one per parameter
    scalars = [c for c in r["collectives"] if c["kind"] == "all-reduce" and c["message_bytes"] <= 16]
    assert sum(c["count"] for c in scalars) <= 4


def test_pipeline_first_and_last_rank_step_through_the_schedule():
    out = _rehearse(*BASE, "model.n_layers=4", "parallel.pp=2", "parallel.tp=4")
    assert out["ok"], out["errors"]
    assert [r["rank"] for r in out["ranks"]] == [0, 32]
    for r in out["ranks"]:
        assert r["memory_bytes"]["params"] == r["plan_memory_bytes"]["params"]
        assert abs(r["ratios"]["comm"]["pp"] - 1) < 0.05
        assert abs(r["ratios"]["flops"] - 1) < 0.02
        sends = sum(c["count"] for c in r["collectives"] if c["axis"] == "pp" and c["kind"] in ("send", "recv"))
        assert sends == 2 * out["microbatches"]


def test_ranks_spec():
    plan = resolve(config_mod.load_config(BASE + ["parallel.pp=2", "parallel.tp=4"])).to_dict()
    assert R.parse_ranks(None, plan) == [0, 32]
    assert R.parse_ranks("all-stages", plan) == [0, 32]
    assert R.parse_ranks("1,3-5", plan) == [1, 3, 4, 5]
    with pytest.raises(R.RanksError):
        R.parse_ranks("64", plan)
    with pytest.raises(R.RanksError):
        R.parse_ranks("x", plan)


def test_cli_bad_ranks_exit_2_and_json_contract(capsys):
    """The front door (launch.py) refuses a bad --ranks before rehearsing anything; the JSON contract
    is the CLI's own main, in this process (the same code launch.py calls: one interpreter's imports
    fewer)."""
    from paralayer import cli

    bad = subprocess.run([sys.executable, "launch.py", *BASE, "--rehearse", "--ranks", "999"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--ranks" in bad.stderr and "Traceback" not in bad.stderr
    assert cli.main([*BASE, "model.n_layers=1", "--rehearse", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["ranks"][0]
    for key in ("rank", "coords", "memory_bytes", "plan_memory_bytes", "collectives", "plan_comm", "flops",
                "plan_flops", "seconds"):
        assert key in r
    assert set(r["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    assert set(r["collectives"][0]) >= {"axis", "kind", "message_bytes", "count"}


def test_a_layout_that_does_not_fit_exits_2(capsys):
    from paralayer import cli

    rc = cli.main([*BASE, "model.n_layers=1", "cluster.device_memory_gib=1", "--rehearse"])
    assert rc == 2 and "needs" in capsys.readouterr().err


def _clip_worker(rank: int, world: int) -> list[float]:
    """tp 2 × dp 2 grads as DTensors (Shard on tp, Shard on dp, Replicate): our bounded-collective
    clip against torch's clip_grad_norm_ (full_tensor per parameter) on copies of the same grads."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from paralayer.parallel.data import clip_grad_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(8, 6, generator=g) * 3 for _ in range(3)]
    specs = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(0), Replicate()]]

    def params():
        out = []
        for f, pl in zip(fulls, specs):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(f), mesh, pl))
            p.grad = distribute_tensor(f.clone(), mesh, pl)
            out.append(p)
        return out

    ours, ref = params(), params()
    n = clip_grad_norm(ours, 1.0, None)
    n_ref = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    err = max(float((a.grad.full_tensor() - b.grad.full_tensor()).abs().max()) for a, b in zip(ours, ref))
    return [n, n_ref, err]


def test_clip_grad_norm_bounded_collectives_matches_torch():
    from tests.dist import run_ranks

    for n, n_ref, err in run_ranks(_clip_worker, 4):
        assert n > 1.0 and abs(n - n_ref) < 1e-4 * n_ref and err < 1e-6


def test_moe_expert_parallel_rank_with_even_router():
    """mixtral-8x7b's layout (tp 2, pp 4, ep 8, 64 ranks) at 4 layers: the all-to-alls, the
    experts' memory and FLOPs as the plan says."""
    out = _rehearse("recipe=mixtral-8x7b", "model.n_layers=4", "train.precision=fp32", ranks=[0])
    assert out["ok"], out["errors"]
    (r,) = out["ranks"]
    assert r["coords"]["ep"] == 0
    for k in ("params", "grads", "optimizer"):
        assert r["memory_bytes"][k] == r["plan_memory_bytes"][k], k
    assert abs(r["ratios"]["activations"] - 1) < 0.05 and abs(r["ratios"]["flops"] - 1) < 0.02
    for ax in ("ep", "pp", "dp", "tp"):
        assert abs(r["ratios"]["comm"][ax] - 1) < 0.05, (ax, r["ratios"]["comm"])
    assert any("evenly" in n for n in out["notes"])


def test_preflight_rehearses_first_and_last_stage(capsys):
    """What launch.py runs before a SLURM submission (tiny-pp: pp 2 → ranks 0 and 4)."""
    cfg = config_mod.load_config(["recipe=tiny-pp"])
    plan = resolve(cfg).to_dict()
    assert R.preflight(cfg, plan) == 0
    err = capsys.readouterr().err
    assert "pre-flight rehearsal of ranks [0, 4] passed" in err
