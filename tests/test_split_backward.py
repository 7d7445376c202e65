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
        from paralayer.parallel.tensor import sequence_parallel as sp

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
        from paralayer.parallel.tensor.tp_overlap import TpOverlap

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
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

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


#: pp 2 × tp 2 under the V schedules, by test id: they train in turn in ONE forked world
V_TP2 = {"dualpipev-tp2": ("dualpipev", ["parallel.tp=2"]),                                # SP
         "zbv-tp2-overlap": ("zbv", ["parallel.tp=2", "parallel.tp_overlap=true"]),         # SP over the ring
         "dualpipev-tp2-overlap": ("dualpipev", ["parallel.tp=2", "parallel.tp_overlap=true"])}


@pytest.fixture(scope="module")
def v_tp2_runs(tmp_path_factory):
    from tests.test_pipeline import _e2e_many

    layouts = [["parallel.dp=1", "parallel.pp=2", f"parallel.schedule={s}"] + lay for s, lay in V_TP2.values()]
    return dict(zip(V_TP2, _e2e_many(tmp_path_factory.getbasetemp(), layouts)))


@pytest.mark.parametrize("case", list(V_TP2))
def test_train_parity_v_schedules_tp2(tmp_path_factory, v_tp2_runs, case):
    """pp 2 × tp 2 through train(): 2 steps' losses and grad norms equal one process's (1e-5)."""
    from tests.test_pipeline import _assert_e2e_parity, _e2e_ref

    _assert_e2e_parity(v_tp2_runs[case], _e2e_ref(tmp_path_factory.getbasetemp()), V_TP2[case])


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


def _torch_order(schedule: str, p: int, m: int, rank: int) -> list[tuple[int, str, int]]:
    """torch's own action order for one rank, as (stage, F/I/W/B, microbatch)."""
    import re

    from torch.distributed.pipelining import schedules as S

    cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[schedule]
    sched = cls.__new__(cls)  # the order needs only these three numbers, not stages
    sched._n_microbatches, sched.pp_group_size, sched.num_stages = m, p, 2 * p
    out = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is not None:
            out += [(int(s), t, int(j)) for s, t, j in re.findall(r"(\d+)([FIWB])(\d+)", str(a))]
    return out


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_input_pass_reruns_are_torchs_split_backwards(schedule):
    """The plan's count of split backwards per chunk (each reruns a fully recomputed layer once
    more) is torch's order's count of input passes, for every chunk of p = 2..16, m from 2p."""
    from paralayer.resolve.memory.states import input_pass_reruns

    for p in (2, 3, 4, 8, 16):
        for m in (2 * p, 2 * p + 3, 8 * p):
            for rank in range(p):
                order = _torch_order(schedule, p, m, rank)
                for c in {s for s, _, _ in order}:
                    want = 0 if c == 0 else sum(1 for s, t, _ in order if s == c and t == "I")
                    assert input_pass_reruns(schedule, p, m, c) == want, (p, m, rank, c)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_full_recompute_rehearse_the_plans_flops_and_all_to_all(schedule):
    """Before paralayer.model.recompute, torch's checkpoint reran a layer in the input pass and
    again per parameter group of the weight pass: tiny-moe pp2 dualpipev read FLOPs 1.287 / 1.611
    and ep 1.417 / 1.834 of the plan (one rerun). Now every rank's FLOPs and all-to-all bytes are
    the plan's, which counts the weight pass's second rerun (memory_states.input_pass_reruns) in
    the FLOPs and, since cost.comm_facts.split_reruns, in the traffic (before: ep 1.083 / 1.333 on
    deepseek-v3-tiny, 1.156 on deepseek-v3's published layout at full depth)."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

    cfg = config_mod.load_config(["recipe=tiny-moe", "parallel.pp=2", "train.precision=fp32",
                                  f"parallel.schedule={schedule}", "parallel.recompute=full", "train.micro_batch=2"])
    from paralayer.resolve.memory import is_moe_layer
    from paralayer.resolve.memory.states import input_pass_reruns

    plan = resolve(cfg).to_dict()
    out = R.rehearse(cfg, plan, [0, 2])
    assert not out["errors"], out["errors"]
    assert len(out["ranks"]) == 2
    p, m, layers = 2, plan["microbatches"], plan["stage_layers"]
    for r in out["ranks"]:
        print(schedule, r["rank"], r["ratios"])
        assert abs(r["ratios"]["flops"] - 1) < 1e-6
        # the weight pass's second rerun of each split backward adds one dispatch + combine per
        # MoE layer of its chunk: the rank sends 6 per MoE layer and microbatch plus those
        pp_rank = r["coords"]["pp"]
        chunks = (pp_rank, 2 * p - 1 - pp_rank)
        n_moe = sum(sum(1 for i in layers[c] if is_moe_layer(cfg, i)) for c in chunks)
        extra = sum(2 * input_pass_reruns(schedule, p, m, c) * sum(1 for i in layers[c] if is_moe_layer(cfg, i))
                    for c in chunks)
        assert extra > 0
        sent = [c for c in r["collectives"] if c["axis"] == "ep" and c["kind"] == "all-to-all"]
        assert max(c["count"] for c in sent) == 6 * n_moe * m + extra, sent
        assert r["ratios"]["comm"]["ep"] == pytest.approx(1, abs=1e-3)


@pytest.mark.parametrize("schedule,axis,layout", [
    ("zbv", "tp", ["parallel.tp=2", "parallel.dp=1"]),
    ("dualpipev", "cp", ["parallel.cp=2", "parallel.dp=1"]),
    ("dualpipev", "cp", ["parallel.cp=2", "parallel.dp=1", "model.sliding_window=8"]),
], ids=["zbv-tp2", "dualpipev-cp2", "dualpipev-cp2-window"])
def test_v_schedules_full_recompute_rehearse_the_plans_tp_and_cp_bytes(schedule, axis, layout):
    """A split backward's second rerun repeats the layer's tp collectives and its cp ring: the plan
    counts them (before: tp 1.125 / 1.285 on ranks 0 / 2 under zbv, cp 1.025 / 1.05 under
    dualpipev)."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve import resolve

    cfg = config_mod.load_config(["recipe=tiny", "parallel.pp=2", "train.precision=fp32", "train.global_batch=32",
                                  f"parallel.schedule={schedule}", "parallel.recompute=full", *layout])
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    out = R.rehearse(cfg, plan, [0, 2])
    assert not out["errors"], out["errors"]
    for r in out["ranks"]:
        print(schedule, axis, r["rank"], r["ratios"])
        assert r["ratios"]["comm"][axis] == pytest.approx(1, abs=1e-3)
        assert abs(r["ratios"]["flops"] - 1) < 1e-6


# ------------------------------------------------------------------ (from tests/test_pipeline.py: the V orders)
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_bubble_formula_matches_torch_order(schedule):
    """The resolver's bubble for the V schedules is the replay of the order torch generates (every
    action one unit long, no communication time), for p = 2..8 and m from the least it accepts."""
    import importlib.util
    import os

    from torch.distributed.pipelining import schedules as S

    from paralayer.parallel.pipeline import timeline as tl
    from paralayer.resolve.cost import bubble_fraction

    spec = importlib.util.spec_from_file_location(
        "bubble_bench", os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "bubble.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cls = {"zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}[schedule]
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "FULL_BACKWARD": "B", "BACKWARD_WEIGHT": "W"}
    for p in (2, 3, 4, 8):
        for m in range(2 * p if schedule == "dualpipev" else p, 4 * p + 1):
            rows = []
            for rank in range(p):
                sch = cls.__new__(cls)  # only the order generator: no stages, no process group
                sch.pp_group_size, sch._n_microbatches, sch.n_local_stages = p, m, 2
                sch._num_stages = sch.num_stages = 2 * p
                sch.rank = rank
                sch.stage_index_to_group_rank = {i: (i if i < p else 2 * p - 1 - i) for i in range(2 * p)}
                evs = []
                for a in sch._calculate_single_rank_operations(rank):
                    for x in (getattr(a, "sub_actions", None) or [a]) if a is not None else []:
                        k = kinds.get(str(x.computation_type).split(".")[-1])
                        if k:
                            n = len(evs)
                            evs.append({"action": k, "mb": x.microbatch_index, "chunk": x.stage_index,
                                        "start": float(n), "end": n + (2.0 if k == "B" and "FULL" in
                                                                       str(x.computation_type) else 1.0)})
                rows.append(evs)
            got = tl.bubble_from_timelines(bench.simulate(rows))
            assert got == pytest.approx(bubble_fraction(schedule, p, m), abs=1e-9), (p, m, got)


def test_bubble_definition_gives_formula_for_ideal_gpipe():
    # p stages, m microbatches, forward 1, backward 2: the ideal GPipe timeline
    import math

    from paralayer.parallel.pipeline import timeline as tl

    p, m = 4, 8
    rows = []
    for r in range(p):
        ev = [{"action": "F", "mb": i, "chunk": r, "start": r + i, "end": r + i + 1} for i in range(m)]
        b0 = (m + p - 1) + 2 * (p - 1 - r)
        ev += [{"action": "B", "mb": i, "chunk": r, "start": b0 + 2 * i, "end": b0 + 2 * i + 2} for i in range(m)]
        rows.append(ev)
    assert math.isclose(tl.bubble_from_timelines(rows), (p - 1) / m)
