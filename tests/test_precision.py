"""bf16: FSDP2's MixedPrecisionPolicy under ZeRO 2/3, autocast elsewhere; parity with fp32 and the
memory the plan counts for each.

bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 0.2% per op). Over 3 steps of this tiny
model bf16 was measured within 2.4e-4 (autocast) and 3.4e-4 (FSDP2) of fp32's loss, relative, and
within 5.7e-4 and 2.8e-3 of its grad norm (pp 2 × dp 2 × ZeRO-2: 2.3e-4 and 2.8e-3): REL and GRAD_REL
leave about 5× of that, loose against bf16's rounding, tight against a missing 1/dp or a cast in
the wrong place.
bf16 on this CPU is slow (no bf16 instructions): shapes are tiny.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import TINY_SMALL, cfg_and_plan, run_ranks, train_records

BASE = TINY_SMALL + ["train.steps=3", "model.init_std=0.2", "model.d_model=32", "model.n_heads=4",
                     "model.n_kv_heads=2", "model.ffn_hidden=64", "model.seq_len=32", "train.global_batch=4",
                     "train.micro_batch=2"]
REL = 2e-3        # loss, relative
GRAD_REL = 1.5e-2  # grad norm, relative


def _pair(rank, world, overrides):
    return train_records(overrides + ["train.precision=fp32"]), train_records(overrides + ["train.precision=bf16"])


def _check(fp32: list[dict], bf16: list[dict]) -> None:
    assert len(fp32) == len(bf16) == 3
    for a, b in zip(fp32, bf16):
        assert abs(a["loss"] - b["loss"]) <= REL * a["loss"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= GRAD_REL * a["grad_norm"], (a["step"], a["grad_norm"],
                                                                                   b["grad_norm"])
        assert a["loss"] != b["loss"], "bf16 must actually compute in bf16"
    assert fp32[0]["loss"] - fp32[-1]["loss"] > 1e-2


@pytest.mark.parametrize("world,extra", [(1, ["parallel.dp=1"]),                       # autocast
                                         (2, ["parallel.dp=2", "parallel.zero=2"]),   # FSDP2 mixed precision
                                         (2, ["parallel.dp=1", "parallel.pp=2"])])    # autocast, bf16 between stages
def test_bf16_matches_fp32(world, extra):
    out = run_ranks(_pair, world, BASE + extra, timeout_s=400)
    for fp32, bf16 in out:
        _check(fp32, bf16)


def _runtime_dtypes(rank, world, overrides):
    """What the runtime holds and computes with: the master weights' dtype and numel, the dtype a
    block's weights have inside its forward, and whether autocast is on."""
    from paralayer.parallel.tensor import local_tensor
    from paralayer.resolve.plan import Plan
    from paralayer.runtime.train import setup

    cfg, plan = cfg_and_plan(overrides)
    run = setup(cfg, Plan.from_dict(plan), None)
    seen = {}
    layer = next(iter(run.built.chunks[0].layers.values()))

    def hook(mod, args):
        w = mod.attention.wq.weight
        seen["compute_dtype"] = str(local_tensor(w).dtype)

    layer.register_forward_pre_hook(hook)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    run.built.chunks[0](x)
    masters = [local_tensor(p) for p in run.built.params]
    return {"master_dtypes": sorted({str(t.dtype) for t in masters}),
            "master_numel": sum(t.numel() for t in masters), "compute_dtype": seen["compute_dtype"],
            "autocast": str(run.autocast_dtype), "plan_memory": plan["memory_per_device_bytes"],
            "params_total": plan["parameters"]["total"]}


def test_runtime_and_plan_agree_on_bf16_state():
    """ZeRO-2 bf16: fp32 shards (1/dp of the weights) step, bf16 copies compute, no autocast; the
    plan counts 4/dp + 2 B weights, 4/dp grads, 8/dp optimizer per parameter. ZeRO-0 bf16: fp32
    weights, autocast; the plan counts 6 B (fp32 + the bf16 copy autocast keeps), 4, 8."""
    fsdp = run_ranks(_runtime_dtypes, 2, BASE + ["parallel.dp=2", "parallel.zero=2", "train.precision=bf16"])
    auto = run_ranks(_runtime_dtypes, 1, BASE + ["parallel.dp=1", "train.precision=bf16"])[0]
    n = fsdp[0]["params_total"]
    for r in fsdp:
        assert r["master_dtypes"] == ["torch.float32"] and r["compute_dtype"] == "torch.bfloat16"
        assert r["autocast"] == "None"
        assert abs(r["master_numel"] - n / 2) <= 64, (r["master_numel"], n)  # FSDP pads each shard a little
        mem = r["plan_memory"]
        assert mem["params"] == int(4 * n / 2 + 2 * n), mem
        assert mem["grads"] == int(4 * n / 2) and mem["optimizer"] == int(8 * n / 2), mem
    assert auto["master_dtypes"] == ["torch.float32"] and auto["compute_dtype"] == "torch.float32"
    assert auto["autocast"] == "torch.bfloat16"
    assert auto["plan_memory"]["params"] == 6 * n and auto["plan_memory"]["grads"] == 4 * n
    assert auto["plan_memory"]["optimizer"] == 8 * n


def test_fused_adamw_matches_foreach():
    """The fused AdamW (CUDA's default here) steps as the foreach one does; on CPU torch has a
    fused kernel too, so the parity is checked here."""
    from paralayer.runtime.optimizer import adamw, implementation

    torch.manual_seed(0)
    init = [torch.randn(40, 24) * 0.2, torch.randn(24) * 0.2]

    def run(fused):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = adamw(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        for s in range(3):
            for p in ps:
                p.grad = torch.sin(p.detach() * (s + 2))
            opt.step()
        return ps, implementation(opt)

    (a, ia), (b, ib) = run(False), run(True)
    assert (ia, ib) == ("foreach", "fused")
    for x, y, x0 in zip(a, b, init):
        assert (x - x0).abs().max() > 1e-3  # it moved
        assert torch.allclose(x, y, atol=1e-6, rtol=0), (x - y).abs().max()
