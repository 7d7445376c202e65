"""ZeRO-2 weights as FSDP2 holds them, in the plan and in the rehearsal (issue 46 item 1).

Under ZeRO-2 (FSDP2, reshard_after_forward=False) a rank holds, from a unit's forward to its
backward, both its fp32 shard (the optimizer's) and the gathered copy: bf16 under
MixedPrecisionPolicy, fp32 without. qwen3-30b-a3b (ep8, ZeRO-2, bf16) at full depth rehearsed
20.66 GB of params against a plan of 14.15 GB: the rehearsal counted the gathered copy in the
shard's fp32 and dropped the shard, while under fp32 both sides dropped the shard. The
per-layer error grows with depth, so the recipe is held at two depths here (its widths, experts,
ep8 and ZeRO-2; 16 ranks so that the experts shard over two expert-data ranks)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paralayer import config as config_mod
from paralayer import rehearse as R
from paralayer.rehearse import memory as rmem
from paralayer.resolve import resolve
from paralayer.resolve.memory import states
from paralayer.resolve.rules import check


def test_fsdp2_holds_the_shard_beside_the_gathered_copy():
    """The fact both counts rest on, read off torch's FSDP2 itself (fake process group, world 4):
    after forward the sharded and the unsharded parameter are separate storages, and
    ``param_bytes`` counts exactly their bytes, for fp32 and for bf16 gathers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from paralayer.compat import fake_store

    dist.init_process_group("fake", rank=0, world_size=4, store=fake_store())
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))
        for dtype in (None, torch.bfloat16):
            lin = torch.nn.Linear(8, 16, bias=False)
            fully_shard(lin, mesh=mesh, reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
            sharded = list(lin.parameters())
            lin(torch.randn(2, 8))
            fp = lin._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
            shard, whole = fp._sharded_param_data, fp._unsharded_param
            assert shard.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), dtype
            real = shard.numel() * shard.element_size() + whole.numel() * whole.element_size()
            gather = 2 if dtype is torch.bfloat16 else 4
            assert real == 4 * 16 * 8 // 4 + gather * 16 * 8, (dtype, real)
            assert rmem.param_bytes(sharded, True, dtype) == real, dtype
            assert rmem.param_bytes(sharded) == 4 * 16 * 8 // 4  # without ZeRO-2's gather: the shard
    finally:
        dist.destroy_process_group()


CASES = {
    "bf16-2": ["model.n_layers=2"],
    "bf16-4": ["model.n_layers=4"],
    "fp32-2": ["model.n_layers=2", "train.precision=fp32"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_qwen3_30b_a3b_zero2_params_exact_at_two_depths(name):
    """Params, grads and optimizer exact on rank 0, and the params are the grads' fp32 shards plus
    the gathered copy of every weight the rank holds (2 B each in bf16, 4 B in fp32). Failed on
    the old code: bf16 rehearsed 4 B per weight (2-layer: 3,246,434,304 vs plan 2,090,360,448);
    fp32 planned and rehearsed 4 B per weight, without the shard."""
    cfg = config_mod.load_config(["recipe=qwen3-30b-a3b", "cluster.nodes=2", *CASES[name]])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    assert plan["degrees"]["ep"] == 8 and plan["degrees"]["dp"] == 16 and plan["zero"] == 2
    out = R.rehearse(cfg, plan, [0])
    assert out["ok"], out.get("errors")
    r = out["ranks"][0]
    for part in ("params", "grads", "optimizer"):
        assert r["memory_bytes"][part] == r["plan_memory_bytes"][part], (name, part, r["ratios"])
    dense, expert, _ = states.rank_params(cfg, check(cfg), 0)
    gather = 2 if plan["precision"] == "bf16" else 4
    assert r["memory_bytes"]["params"] == r["memory_bytes"]["grads"] + gather * (dense + expert), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero2_under_a_pipeline_counts_the_gathered_weights(precision):
    """tiny (tp2) at pp2·dp2 ZeRO-2: the stages keep their gathered weights through the step as
    without pp (parallel/pipeline/stage_hooks.py reshards only under ZeRO-3), and under tp FSDP
    shards with _StridedShard, which is_shard() does not count. Failed on the old code: the
    rehearsal counted the shards only under pp (fp32: 402,432 B against a plan of 804,864)."""
    cfg = config_mod.load_config(["recipe=tiny", "parallel.pp=2", "parallel.dp=2", "parallel.zero=2",
                                  f"train.precision={precision}"])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"] and plan["degrees"]["tp"] == 2, plan["errors"]
    out = R.rehearse(cfg, plan, [0, 2])
    assert out["ok"] and len(out["ranks"]) == 2, out.get("errors")
    lay = check(cfg)
    for r in out["ranks"]:
        for part in ("params", "grads", "optimizer"):
            assert r["memory_bytes"][part] == r["plan_memory_bytes"][part], (precision, r["rank"], part)
        dense, expert, _ = states.rank_params(cfg, lay, r["coords"]["pp"])
        gather = 2 if precision == "bf16" else 4
        assert r["memory_bytes"]["params"] == r["memory_bytes"]["grads"] + gather * (dense + expert), r["rank"]
