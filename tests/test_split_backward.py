"""The fused sequence-parallel GEMMs under torch's split backward (zbv, dualpipev): the input pass
computes grad-input only (with its reduce-scatter), the weight pass grad-weight only (with the
re-gather the column GEMM's weight grad needs), so the two passes together issue the collectives
and GEMM FLOPs of one plain backward, and give its gradients."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks

torch.set_num_threads(1)

B, S, H, O = 2, 8, 6, 10  # per-rank sequence shard S/tp


class _Stage(torch.nn.Module):
    """A stage the shape of one SP block: scale (a norm), column pair, product, row GEMM."""

    def __init__(self, gemms, tp: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gemms = gemms
        self.scale = torch.nn.Parameter(0.2 * torch.randn(H, generator=g) + 1)
        self.w1 = torch.nn.Parameter(0.2 * torch.randn(O, H, generator=g))
        self.w3 = torch.nn.Parameter(0.2 * torch.randn(O, H, generator=g))
        self.w2 = torch.nn.Parameter(0.2 * torch.randn(H, O, generator=g))

    def forward(self, x):
        a, c = self.gemms.gather_matmul(x * self.scale, [self.w1, self.w3])
        return self.gemms.matmul_scatter(a * c, self.w2)


def _counting(impl: str, group):
    """The fused GEMM helper, and a dict counting its collectives by kind."""
    counts = {"gather": 0, "scatter": 0, "ring": 0}
    if impl == "sp":
        from paralayer.parallel import sequence_parallel as sp

        gemms = sp.SpGemms(group)
        start_gather, start_scatter = sp._start_gather, sp._start_scatter

        def gather(*a):
            counts["gather"] += 1
            return start_gather(*a)

        def scatter(*a):
            counts["scatter"] += 1
            return start_scatter(*a)

        sp._start_gather, sp._start_scatter = gather, scatter  # in this child process only
    else:
        from paralayer.parallel.tp_overlap import TpOverlap

        gemms = TpOverlap(group)
        start = gemms.ring.start

        def ring_start(*a):
            counts["ring"] += 1
            return start(*a)

        gemms.ring.start = ring_start
    return gemms, counts


def _pass(counts: dict, fn):
    """Run ``fn``; the collectives and FLOPs it issued."""
    from torch.utils.flop_counter import FlopCounterMode

    before = dict(counts)
    with FlopCounterMode(display=False) as fc:
        fn()
    return {k: counts[k] - before[k] for k in counts} | {"flops": fc.get_total_flops()}


def _worker(rank: int, world: int, impl: str):
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    gemms, counts = _counting(impl, dist.group.WORLD)
    stage = _Stage(gemms, world)
    g = torch.Generator().manual_seed(1 + rank)
    x0 = torch.randn(B, S, H, generator=g)
    dy = torch.randn(B, S, H, generator=g)

    def run(split: bool):
        stage.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)  # a received activation: a leaf that wants its grad
        y = stage(x)
        if not split:
            full = _pass(counts, lambda: y.backward(dy))
            return x.grad, {n: p.grad.clone() for n, p in stage.named_parameters()}, [full]
        out = {}

        def inp():
            out["groups"] = stage_backward_input([y], [dy], [x], stage.parameters())[1]

        i = _pass(counts, inp)
        w = _pass(counts, lambda: stage_backward_weight(stage.parameters(), out["groups"]))
        return x.grad, {n: p.grad.clone() for n, p in stage.named_parameters()}, [i, w]

    gx_ref, gw_ref, (full,) = run(False)
    gx, gw, (i, w) = run(True)
    return {"full": full, "input": i, "weight": w,
            "gx_err": ((gx - gx_ref).abs().max() / gx_ref.abs().max()).item(),
            "gw_err": max(((gw[n] - gw_ref[n]).abs().max() / gw_ref[n].abs().max()).item() for n in gw_ref)}


@pytest.mark.parametrize("impl", ["sp", "overlap"])
def test_split_backward_does_each_gradient_once(impl):
    for r in run_ranks(_worker, 2, impl):
        full, i, w = r["full"], r["input"], r["weight"]
        print(impl, "full", full, "input", i, "weight", w, "errs", r["gx_err"], r["gw_err"])
        assert r["gx_err"] < 1e-6 and r["gw_err"] < 1e-6
        # the two passes together: the collectives and FLOPs of one plain backward
        assert {k: i[k] + w[k] for k in full} == full
        assert full["flops"] > 0 and i["flops"] > 0 and w["flops"] > 0
        if impl == "sp":  # input pass: row gather + column scatter; weight pass: column re-gather
            assert (i["gather"], i["scatter"], w["gather"], w["scatter"]) == (1, 1, 1, 0)
        else:             # one ring walk (tp − 1 = 1 exchange) per collective
            assert (i["ring"], w["ring"]) == (2, 1)


# ------------------------------------------------------------------ the whole runtime
@pytest.mark.parametrize("schedule,overlap", [("zbv", False), ("dualpipev", True)])
def test_v_schedule_rehearsal_counts_the_plans_tp_bytes_and_flops(schedule, overlap):
    """llama3-8b widths, tp 2 · pp 2 at 64 ranks, 4 layers: the V schedule's rank 0 (the first and
    the last chunk) sends the plan's tp bytes and does its FLOPs (before: tp 1.25 / 1.05, FLOPs
    1.125 / 1.031: every fused backward ran in both passes)."""
    from paralayer import config as config_mod
    from paralayer.resolve import resolve
    from paralayer import rehearse as R

    cfg = config_mod.load_config(["recipe=llama3-8b", "cluster.nodes=8", "train.precision=fp32", "model.n_layers=4",
                                  "parallel.tp=2", "parallel.pp=2", f"parallel.schedule={schedule}",
                                  f"parallel.tp_overlap={str(overlap).lower()}"])
    plan = resolve(cfg).to_dict()
    out = R.rehearse(cfg, plan, [0])
    assert out["ok"], out["errors"]
    (r,) = out["ranks"]
    print(schedule, overlap, r["ratios"])
    assert abs(r["ratios"]["comm"]["tp"] - 1) < 1e-3
    assert abs(r["ratios"]["flops"] - 1) < 1e-3


@pytest.mark.parametrize("schedule,layout", [
    ("dualpipev", ["parallel.tp=2"]),                                   # SP
    ("zbv", ["parallel.tp=2", "parallel.tp_overlap=true"]),             # SP over the ring
    ("dualpipev", ["parallel.tp=2", "parallel.tp_overlap=true"]),
], ids=["dualpipev-tp2", "zbv-tp2-overlap", "dualpipev-tp2-overlap"])
def test_train_parity_v_schedules_tp2(tmp_path_factory, schedule, layout):
    """pp 2 × tp 2 through train(): 5 steps' losses and grad norms equal one process's (1e-5)."""
    from tests.test_pipeline import _assert_e2e_parity, _e2e, _e2e_ref

    tmp = tmp_path_factory.getbasetemp()
    out = _e2e(tmp, ["parallel.dp=1", "parallel.pp=2", f"parallel.schedule={schedule}"] + layout)
    _assert_e2e_parity(out, _e2e_ref(tmp), (schedule, layout))


def test_resolver_accepts_tp_overlap_under_the_v_schedules():
    """No warning for zbv/dualpipev + tp_overlap any more (the test above: each ring runs once);
    the timing model's row-GEMM backward rings hide behind the input-grad GEMM only there (the
    weight grad runs in the weight pass)."""
    from paralayer.config import load_config
    from paralayer.resolve import cost
    from paralayer.resolve.plan import resolve

    base = ["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=64", "parallel.tp=8", "parallel.pp=4",
            "parallel.tp_overlap=true"]
    for schedule in ("zbv", "dualpipev"):
        plan = resolve(load_config(base + [f"parallel.schedule={schedule}"])).to_dict()
        assert not plan["errors"], plan["errors"]
        assert not [w for w in plan["warnings"] if w["field"] == "parallel.tp_overlap"], plan["warnings"]
        assert plan["tp_overlap"] is True
    cfg = load_config(base)
    plain, split = cost.tp_ring_flops(cfg, 8, "none"), cost.tp_ring_flops(cfg, 8, "none", True)
    rows = (6, 9)  # backward rings: wq/wk/wv gather, scatter; wo gather; w1/w3 gather, scatter; w2 gather
    assert all(s == (p / 2 if i in rows else p) for i, (s, p) in enumerate(zip(split[0], plain[0])))


def test_resolver_warns_that_v_schedules_recompute_full_layers_twice():
    """Under zbv/dualpipev with recompute=full the checkpoint recomputes a layer in both passes
    (rehearsed at tp2 pp2: FLOPs 1.436, tp bytes 1.750 of the plan): the resolver says so, naming
    parallel.recompute; not under 1f1b, not with selective."""
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    base = ["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=64", "parallel.tp=8", "parallel.pp=4"]

    def warned(*ov):
        plan = resolve(load_config(base + list(ov))).to_dict()
        return [w for w in plan["warnings"] if w["field"] == "parallel.recompute"]

    for schedule in ("zbv", "dualpipev"):
        w = warned(f"parallel.schedule={schedule}", "parallel.recompute=full")
        assert len(w) == 1 and "both its input-grad and its weight-grad pass" in w[0]["message"], w
        assert not warned(f"parallel.schedule={schedule}", "parallel.recompute=selective")
    assert not warned("parallel.schedule=1f1b", "parallel.recompute=full")
