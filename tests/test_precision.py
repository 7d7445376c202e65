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
    weights, autocast; the plan counts 4 B per weight + 2 B per weight whose bf16 copy autocast keeps
    (tp 1: every GEMM's, the head's; not the embedding's or the norms'), 4, 8."""
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
    cfg, _ = cfg_and_plan(BASE + ["parallel.dp=1", "train.precision=bf16"])
    m = cfg.model
    hd = m.d_model // m.n_heads
    gemms = m.n_layers * (m.d_model * hd * 2 * (m.n_heads + m.n_kv_heads) + 3 * m.d_model * m.ffn_hidden)
    gemms += m.vocab_size * m.d_model  # the head (tp 1: the vocab is not padded)
    assert auto["plan_memory"]["params"] == 4 * n + 2 * gemms and auto["plan_memory"]["grads"] == 4 * n
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


# ------------------------------------------------------------------ autocast's bf16 weight copies
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=48", "model.moe.capacity_factor=null"]


def _shared_vs_per_microbatch(rank, world, overrides):
    """fp32; bf16 as the runtime runs it (the experts' bf16 copy shared by the step's microbatches,
    model/moe.py shared_weight_casts); bf16 with a copy per microbatch (before: the context a no-op)."""
    import contextlib

    from paralayer.parallel.pipeline import runner as pipeline  # the module whose step() looks it up
    from paralayer.runtime import train as T

    fp32 = train_records(overrides + ["train.precision=fp32"])
    shared = train_records(overrides + ["train.precision=bf16"])
    saved = pipeline.shared_weight_casts, T.shared_weight_casts
    pipeline.shared_weight_casts = T.shared_weight_casts = lambda roots: contextlib.nullcontext()
    try:
        per_mb = train_records(overrides + ["train.precision=bf16"])
    finally:
        pipeline.shared_weight_casts, T.shared_weight_casts = saved
    return fp32, shared, per_mb


@pytest.mark.parametrize("world,extra", [(2, ["parallel.dp=1", "parallel.pp=2"]),    # 2 microbatches in flight
                                         (1, ["parallel.dp=1"])])                    # no pp
def test_experts_share_one_bf16_copy_with_the_same_numbers(world, extra):
    """MoE under autocast: one bf16 copy of the experts per step instead of one per microbatch.
    The numbers are those of the copy per microbatch, bit for bit (a slice of the cast is the cast
    of the slice; the gradients meet in fp32 as before), and bf16 stays within fp32's tolerance."""
    out = run_ranks(_shared_vs_per_microbatch, world, BASE + MOE + ["train.global_batch=8"] + extra, timeout_s=600)
    for fp32, shared, per_mb in out:
        _check(fp32, shared)
        assert [(r["loss"], r["grad_norm"]) for r in shared] == [(r["loss"], r["grad_norm"]) for r in per_mb]


def _copies_expected(cfg, lay, pp_rank: int) -> float:
    """The weight elements whose bf16 copy pp_rank keeps at its peak, counted here from the model's
    shapes (not with resolve/memory/autocast.py's function): the head; the layers' GEMMs without SP; an MoE
    block's router, shared expert and local experts; a fully recomputed layer's copies are made
    again in its backward, after the head's backward (the larger of the two)."""
    from paralayer.resolve.memory import rank_chunks

    m = cfg.model
    h, t = m.d_model, lay.tp
    hd = h // m.n_heads
    attn = h * hd * 2 * (m.n_heads + m.n_kv_heads) / t
    chunks = rank_chunks(lay, pp_rank)
    head = lay.padded_vocab * h / t if lay.chunks - 1 in chunks else 0.0
    n, again = 0.0, 0.0
    for c in chunks:
        for i in lay.stage_layers[c]:
            split = 0.0 if lay.sequence_parallel else attn
            if m.moe.num_experts:
                fe = m.moe.ffn_hidden
                layer = (split + h * m.moe.num_experts + 3 * h * m.moe.shared_ffn_hidden
                         + 3 * h * fe * m.moe.num_experts / lay.ep)
            else:
                layer = split + (0.0 if lay.sequence_parallel else 3 * h * m.ffn_hidden / t)
            if lay.recompute == "full":  # cast again in its backward, after the head's backward
                again = max(again, layer)
            else:
                n += layer
    return n + max(head, again)


@pytest.mark.parametrize("extra", [
    ["parallel.tp=2", "parallel.dp=1"],                                            # SP: the head only
    ["parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=false"],        # + every layer GEMM
    ["parallel.tp=1", "parallel.pp=2", "parallel.dp=1", "train.global_batch=16"],   # 2 in flight, 1 copy
    ["parallel.tp=1", "parallel.dp=1", "parallel.recompute=full"],                  # the head or a layer
    ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "train.global_batch=32", *MOE],  # experts, 2 in flight
], ids=["tp2-sp", "tp2-nosp", "pp2", "full", "moe-pp2-ep2"])
def test_rehearsed_weight_copies_equal_the_plan(extra):
    """Under bf16 autocast the rehearsal measures the bf16 weight copies autograd keeps
    (``weight_copy_bytes``, the live peak of saved casts of weights); the plan's params are the fp32
    weights plus those copies: equal to the byte, on every pipeline rank."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve, rules

    # 2 layers (tiny's 4 halved): still a layer per pipeline stage, every copy counted per layer
    cfg = config_mod.load_config(["recipe=tiny", "train.precision=bf16", "parallel.zero=1", "model.n_layers=2", *extra])
    plan = resolve(cfg).to_dict()
    out = R.rehearse(cfg, plan, R.parse_ranks("all-stages", plan))
    assert out["ok"], out["errors"]
    lay = rules.check(cfg)
    for r in out["ranks"]:
        want = 2 * _copies_expected(cfg, lay, r["coords"]["pp"])
        assert want > 0
        assert r["weight_copy_bytes"] == want, (r["rank"], r["weight_copy_bytes"], want)
        assert r["memory_bytes"]["params"] == r["plan_memory_bytes"]["params"], r["rank"]
