"""Muon on one rank (issue #47 item 5): the pieces, and ``train()`` against a plain reference.

The reference is written here from the Muon paper's update (Keller Jordan's post, Moonshot's
"Muon is Scalable for LLM Training"), for every matrix of the blocks:
``B ← μB + G``, ``U = G + μB`` (Nesterov), ``X = U/‖U‖_F`` (transposed when tall),
5 × ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``, ``W ← W(1 − lr·wd) − lr·0.2·√max(m, n)·X``; experts'
3-D weights matrix by matrix; torch.optim.AdamW for the embedding, head and norms. torch's
Muon keeps the momentum as an average (B ← μB + (1−μ)G), a (1−μ) multiple of the paper's; the
normalisation removes it, so the two agree to rounding. Loss and grad norm must agree over
4 steps at init std 0.2; a Newton-Schulz step skipped in ours must not.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist import cfg_and_plan, paired, run_ranks, write_tokens

SEQ, VOCAB, GB, STEPS = 32, 64, 8, 4
LR, WD, MU = 2e-2, 0.1, 0.95
BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48",
        f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.init_std=0.2", "parallel.dp=1", "parallel.tp=1",
        f"train.global_batch={GB}", "train.micro_batch=2", f"train.steps={STEPS}", f"train.lr={LR}",
        "train.warmup_steps=0", "train.min_lr_ratio=1.0", f"train.weight_decay={WD}", "train.grad_clip=0",
        "train.precision=fp32", "train.threads=1", "data.format=tokens", "data.shuffle=false",
        "train.optimizer=muon", f"train.muon.momentum={MU}", "logging.wandb.mode=disabled",
        "logging.progress=false", "cluster.device=cpu"]
TOL = 1e-5


def _paper_ns(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / x.norm()
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def _reference(cfg, token_path: str, clip=None) -> list[dict]:
    """The plain loop: our model and init, the paper's Muon written above, torch's AdamW;
    ``clip(model)``: a callable run after each update that returns extra keys of the step's record
    (tests/test_qk_clip.py's QK-clip)."""
    from paralayer.model.transformer import Transformer, init_weights

    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    init_weights(model, cfg.model, cfg.train.seed)
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.ndim >= 2 and "tok_embeddings" not in n and not n.startswith("output")]
    ids_m = {id(p) for p in matrices}
    rest = [(n, p) for n, p in named if id(p) not in ids_m]
    adam = torch.optim.AdamW([{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": WD},
                              {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    bufs = {id(p): torch.zeros_like(p) for p in matrices}
    after_step = clip(model) if clip is not None else dict
    with open(token_path) as f:
        lines = [json.loads(ln)["input_ids"] for ln in f]
    out = []
    for step in range(1, STEPS + 1):
        ids = torch.tensor(lines[(step - 1) * GB: step * GB])
        for p in model.parameters():
            p.grad = None
        # the whole line goes in, as the runtime feeds it (the last position's output has no label):
        # the same loss, and the attention QK-clip measures sees the same queries
        loss = F.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        with torch.no_grad():
            for p in matrices:
                B = bufs[id(p)]
                B.mul_(MU).add_(p.grad)
                U = p.grad + MU * B
                m, n = p.shape[-2:]
                X = _paper_ns(U) if p.ndim == 2 else torch.stack([_paper_ns(u) for u in U])
                p.mul_(1 - LR * WD)
                p.sub_(LR * 0.2 * math.sqrt(max(m, n)) * X)
        adam.step()
        out.append({"step": step, "loss": loss.item(), "grad_norm": norm.item(), **after_step()})
    return out


def _both(rank, world, overrides, plants):
    from paralayer.optim import muon
    from paralayer.runtime import train as T

    cfg, plan = cfg_and_plan(BASE + overrides)
    good = muon.newton_schulz
    runs = []
    for plant in plants:
        if plant == "skip_ns_step":
            muon.newton_schulz = lambda g, steps, *a, **k: good(g, steps - 1, *a, **k)
        try:
            runs.append([{k: r[k] for k in ("step", "loss", "grad_norm")} for r in T.train(cfg, plan)])
        finally:
            muon.newton_schulz = good
    return runs, _reference(cfg, overrides[0].split("=", 1)[1])


def _err(ours, ref) -> float:
    return max(max(abs(a[k] - b[k]) / abs(b[k]) for k in ("loss", "grad_norm")) for a, b in paired(ours, ref))


@pytest.mark.timeout(300)
def test_one_rank_equals_the_papers_update_and_a_skipped_ns_step_fails(tmp_path):
    data = f"data.path={write_tokens(os.path.join(tmp_path, 't.jsonl'), GB * STEPS, SEQ, VOCAB)}"
    (ours, skipped), ref = run_ranks(_both, 1, [data], [None, "skip_ns_step"])[0]
    err, err_skip = _err(ours, ref), _err(skipped, ref)
    print(f"muon vs the paper's update: max rel err {err:.2e}; one NS step skipped: {err_skip:.2e}; "
          f"loss {ref[0]['loss']:.4f} -> {ref[-1]['loss']:.4f}")
    assert err <= TOL, (ours, ref)
    assert err_skip > 10 * TOL, (skipped, ref)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1, "the reference must train for the comparison to mean anything"


# ------------------------------------------------------------------ the pieces
def test_newton_schulz_is_torchs_in_bf16_and_orthogonalises():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from paralayer.optim.muon import NS_COEFFICIENTS, newton_schulz

    g = torch.Generator().manual_seed(0)
    for shape in [(48, 80), (80, 48), (64, 64)]:
        x = torch.randn(*shape, generator=g)
        want = _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(newton_schulz(x, 5, dtype=torch.bfloat16), want), shape
        o = newton_schulz(x, 5)  # fp32: singular values in the band torch documents (0.5 .. 1.5), not 1
        s = torch.linalg.svdvals(o)
        assert 0.45 < float(s.min()) and float(s.max()) < 1.5, (shape, s.min(), s.max())
        sx = torch.linalg.svdvals(x)
        assert float(sx.max() / sx.min()) > 5 > 3 > float(s.max() / s.min()) or shape == (64, 64), (sx, s)
    stack = torch.randn(3, 40, 24, generator=g)
    got = newton_schulz(stack, 5)
    for i in range(3):
        assert torch.allclose(got[i], newton_schulz(stack[i], 5), atol=1e-6), i


def test_which_parameters_get_muon():
    from paralayer.optim.muon import uses_muon

    m, v, s = torch.zeros(4, 4), torch.zeros(4), torch.zeros(2, 4, 4)
    assert uses_muon("layers.0.attention.wq.weight", m) and uses_muon("layers.1.feed_forward.w1", s)
    assert uses_muon("layers.0.feed_forward.gate.weight", m) and uses_muon("mtp.layers.0.eh_proj.weight", m)
    assert not uses_muon("tok_embeddings.weight", m) and not uses_muon("output.weight", m)
    assert not uses_muon("layers.0.attention_norm.weight", v) and not uses_muon("mtp.layers.0.embed.weight", m)


def test_adjusted_lr_is_torchs_on_the_last_two_dims():
    from paralayer.optim.muon import adjusted_lr

    assert adjusted_lr(1.0, "match_rms_adamw", (352, 128)) == pytest.approx(0.2 * math.sqrt(352))
    assert adjusted_lr(1.0, "original", (8, 352, 128)) == pytest.approx(math.sqrt(352 / 128))
    assert adjusted_lr(1.0, "original", (128, 352)) == 1.0


def test_owners_balance_by_newton_schulz_cost():
    from paralayer.optim.owners import assign_owners, loads, ns_cost, row_range

    assert ns_cost((352, 128)) == 352 * 128 * 128 and ns_cost((8, 64, 32)) == 8 * 64 * 32 * 32
    shapes = [(128, 128), (64, 128), (64, 128), (128, 128), (352, 128), (352, 128), (128, 352)] * 2
    costs = [ns_cost(s) for s in shapes]
    for world in (2, 3, 4):
        owners = assign_owners(costs, world)
        ld = loads(costs, owners, world)
        assert max(ld) <= sum(costs) / world + max(costs), (world, ld)  # the greedy rule's bound
    assert loads(costs, assign_owners(costs, 2), 2) == [sum(costs) // 2] * 2  # this model splits evenly
    assert [row_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [row_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("bad,field", [("train.optimizer=sgd", "train.optimizer"),
                                       ("train.muon.adjust_lr=keller", "train.muon.adjust_lr"),
                                       ("train.muon.ns_steps=0", "train.muon.ns_steps"),
                                       ("train.muon.momentum=1.5", "train.muon.momentum")])
def test_bad_muon_input_exits_2_naming_the_field(bad, field):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "launch.py", "recipe=tiny", bad, "--dry-run"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------ the plan's memory
@pytest.mark.parametrize("recipe", ["tiny", "deepseek-v3-tiny", "tiny-moe"])
def test_plan_counts_one_momentum_buffer_per_muon_parameter(recipe):
    """One rank: AdamW's optimizer bytes less Muon's are 4 B (one fp32 moment) per parameter that
    uses_muon picks on the real model (experts, MLA's pairs, MTP's projection included)."""
    from paralayer.config import load_config
    from paralayer.model.transformer import Transformer
    from paralayer.optim.muon import split_params
    from paralayer.resolve.plan import resolve

    ov = [f"recipe={recipe}", "parallel.dp=1", "parallel.tp=1", "parallel.ep=1", "parallel.pp=1", "parallel.zero=0"]
    opt = {o: resolve(load_config(ov + [f"train.optimizer={o}"])).to_dict()["memory_per_device_bytes"]["optimizer"]
           for o in ("adamw", "muon")}
    cfg = load_config(ov)
    with torch.device("meta"):
        model = Transformer(cfg.model, resolve(cfg).to_dict()["padded_vocab_size"])
    muon, adam = split_params(model.named_parameters())
    n_muon = sum(p.numel() for p in muon)
    assert n_muon > 0 and adam
    assert opt["adamw"] - opt["muon"] == 4 * n_muon, (opt, n_muon)


@pytest.mark.timeout(300)
def test_rehearsal_holds_the_plans_muon_states(monkeypatch):
    """The runtime's states, Newton-Schulz FLOPs and owners' moves on fake tensors (--rehearse) are the
    plan's for each rank (resolve/cost/optimizer_step.py ``rank_step`` joins plan_flops and plan_comm),
    ep2 · ZeRO-3 on the tiny MoE (the dense rows' two all-to-alls, the experts' local Newton-Schulz);
    the plan with a Newton-Schulz step fewer, or without the moves, disagrees with the same ranks."""
    import subprocess
    import sys

    from paralayer.config import load_config
    from paralayer.rehearse import driver
    from paralayer.resolve.cost import optimizer_step
    from paralayer.resolve.plan import resolve

    ov = ["recipe=tiny-moe", "parallel.zero=3", "train.optimizer=muon"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "launch.py", *ov, "--rehearse", "--json"], cwd=root, capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    ranks = json.loads(r.stdout)["ranks"]
    held = [(x["memory_bytes"]["optimizer"], x["plan_memory_bytes"]["optimizer"]) for x in ranks]
    assert held and all(got == plan > 0 for got, plan in held), held
    for x in ranks:
        step = x["plan_optimizer_step"]
        assert step["flops"] > 0 and step["comm_bytes"], step
        assert _close(x), (x["rank"], x["ratios"])
    plan = resolve(load_config(ov)).to_dict()
    four, _ = driver.rehearsal_config(load_config(ov + ["train.muon.ns_steps=4"]), plan)
    assert not any(driver.beside_the_plan(four, plan, x)["agrees"]["flops"] for x in ranks)
    cfg_run, _ = driver.rehearsal_config(load_config(ov), plan)
    good = optimizer_step.rank_step
    monkeypatch.setattr(optimizer_step, "rank_step", lambda *a: {**good(*a), "collectives": []})
    assert not any(_close(driver.beside_the_plan(cfg_run, plan, x)) for x in ranks)


def _close(rank: dict, tol: float = 1e-3) -> bool:
    """FLOPs and every axis's bytes within ``tol`` of the plan's: tighter than the rehearsal's 2% and 5%
    (they agree to 3e-5 here), so that moves of 4.8% of the ep axis's bytes cannot hide in them."""
    ratios = [rank["ratios"]["flops"], *rank["ratios"]["comm"].values()]
    return all(r is not None and abs(r - 1) <= tol for r in ratios)


@pytest.mark.timeout(300)
def test_rehearsed_zero1_share_is_the_plans_exact_share(monkeypatch):
    """ZeRO-1 over 3 data ranks deals whole parameters unevenly: rank 2's share holds more of Muon's
    matrices (823,132,160 Newton-Schulz FLOPs, the others 710,410,240). Its rehearsed optimizer bytes
    and FLOPs are the plan's for that share (optimizer_step.zero1_owners, memory/muon_states.py);
    a plan that deals the matrices otherwise (all to rank 0) disagrees."""
    from paralayer import rehearse as R
    from paralayer.config import load_config
    from paralayer.rehearse import driver
    from paralayer.resolve import rules
    from paralayer.resolve.cost import optimizer_step
    from paralayer.resolve.plan import resolve

    cfg = load_config(["recipe=tiny", "parallel.tp=1", "parallel.dp=3", "train.global_batch=24", "parallel.zero=1",
                       "train.optimizer=muon"])
    plan = resolve(cfg).to_dict()
    out = R.rehearse(cfg, plan, [2])
    x = out["ranks"][0]
    assert out["ok"] and x["agrees"]["optimizer"] and x["agrees"]["flops"] and x["agrees"]["comm"], x["ratios"]
    assert x["plan_optimizer_step"]["flops"] > optimizer_step.rank_step(cfg, rules.check(cfg), 0, 0)["flops"]
    good = optimizer_step.zero1_owners
    monkeypatch.setattr(optimizer_step, "zero1_owners", lambda *a: [0 for _ in good(*a)])
    cfg_run, _ = driver.rehearsal_config(cfg, plan)
    bad = driver.beside_the_plan(cfg_run, plan, x)
    assert not bad["agrees"]["flops"] and not bad["agrees"]["optimizer"], bad["ratios"]


# ------------------------------------------------------------------ the plan's time and the ranking
def test_the_plan_times_muons_step_and_the_planner_ranks_with_it():
    """predict() (through resolve) adds Muon's step (resolve/cost/optimizer_step.py) to AdamW's, and
    each ranked layout's step time and memory are what resolve + predict give for it."""
    from paralayer.config import load_config
    from paralayer.resolve import planner
    from paralayer.resolve.plan import resolve

    ov = ["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.nodes=8"]
    fixed = ["parallel.tp=1", "parallel.dp=64", "parallel.zero=2"]
    adam, muon = (planner.predict(load_config(ov + fixed + [f"train.optimizer={o}"])) for o in ("adamw", "muon"))
    assert adam["optimizer_s"] == 0.0 < muon["optimizer_s"]
    assert muon["step_time_s"] - adam["step_time_s"] == pytest.approx(muon["optimizer_s"], rel=1e-9)
    cfg = load_config(ov + ["train.optimizer=muon"])
    rows = planner.plan_layouts(cfg, top=3)
    assert rows
    for d in rows:
        c = planner.config_for(cfg, d)
        assert c.train.optimizer == "muon"
        assert resolve(c).memory_per_device_bytes["total"] == d["memory"]["total"]
        assert planner.predict(c)["step_time_s"] == pytest.approx(d["step_time_s"], rel=1e-6), d["degrees"]


def _busiest_device(cfg) -> tuple[float, float]:
    """The oracle: every device's rank_step (pipeline rank, dp·cp place, tp place) one by one, (the
    most seconds, the most FLOPs): its Newton-Schulz FLOPs at the achieved rate, each collective's
    bytes × wire_factor over its axis's bandwidth (these layouts have no expert-dp group)."""
    from paralayer.resolve import rules
    from paralayer.resolve.cost import optimizer_step
    from paralayer.resolve.cost.machine import machine_for, wire_factor
    from paralayer.resolve.plan import resolve

    lay, mach, spans = rules.check(cfg), machine_for(cfg), resolve(cfg).spans
    bw = {ax: mach.bandwidth(spans[ax]) for ax in ("dp", "tp")}
    size = {"dp": lay.dp * lay.cp, "tp": lay.tp}
    steps = [optimizer_step.rank_step(cfg, lay, r, j, t) for r in range(lay.pp) for j in range(lay.dp * lay.cp)
             for t in range(lay.tp)]
    return max(s["flops"] / (mach.peak_tflops * 1e12 * mach.efficiency)
               + sum(c["message_bytes"] * c["count"] * wire_factor(c["kind"], size[c["axis"]]) / bw[c["axis"]]
                     for c in s["collectives"]) for s in steps), max(s["flops"] for s in steps)


def test_optimizer_s_is_the_busiest_devices_exact_step(monkeypatch):
    """optimizer_s is the busiest device's exact step timed: llama3-8b on 64 H100 (tp8 dp8 ZeRO-1:
    0.131 s, where the average owner's model said 1.10 s, the planted error, fails) and
    deepseek-v3-tiny under DualPipeV (pp2: chunks 0, 3 on rank 0; its MTP block on rank 0); the
    plan's optimizer_step is the device with the most FLOPs (llama3-8b: dp place 7's share, 7.90e13;
    planted: dp place 0's, 1.65e13)."""
    from paralayer.config import load_config
    from paralayer.resolve import planner, rules
    from paralayer.resolve.cost import optimizer_step as O
    from paralayer.resolve.cost.machine import machine_for

    for ov in (["recipe=deepseek-v3-tiny", "cluster=h100-80gb-8x", "cluster.devices_per_node=4", "parallel.pp=2",
                "parallel.schedule=dualpipev", "parallel.zero=0", "train.micro_batch=2"],
               ["recipe=llama3-8b", "cluster=h100-80gb-8x", "cluster.nodes=8"]):
        cfg = load_config(ov + ["train.optimizer=muon"])
        (want, most), lay = _busiest_device(cfg), rules.check(cfg)
        assert planner.predict(cfg)["optimizer_s"] == pytest.approx(want, rel=1e-9) and want > 0, ov
        assert O.plan_section(cfg, lay)["flops"] == most, ov
    monkeypatch.setattr(O, "_busiest_dp_index", lambda *a: 0)
    assert O.plan_section(cfg, lay)["flops"] < most
    # planted: the time model before (the mean owner; at tp > 1 every matrix whole on every tp rank,
    # (tp - 1)/tp of it over tp, ZeRO-1 no dp move)
    mach = machine_for(cfg)
    mats = [mx for i in range(cfg.model.n_layers) for mx in O.block_matrices(cfg, i, 1)]
    old = (sum(mx.flops(cfg.train.muon.ns_steps) for mx in mats) / (mach.peak_tflops * 1e12 * mach.efficiency)
           + 4 * sum(mx.numel for mx in mats) * (lay.tp - 1) / lay.tp / mach.bandwidth("intra-node"))
    assert lay.tp == 8 and lay.zero == 1 and old != pytest.approx(want, rel=1e-2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["tiny-qwen3-next", "tiny-gpt-oss"])
def test_muons_side_of_the_optimizer_is_the_steps_matrix_list(recipe):
    """The plan's Muon / AdamW split (resolve/memory/muon_states.muon_split) is the step's matrix list
    (optimizer_step.rank_matrices), as optim/muon.py ``uses_muon`` picks: the 3-D conv weight of a Gated
    DeltaNet layer on Muon, GPT-OSS's 1-D biases, sinks and router bias on AdamW. Rank 0 rehearsed in
    process holds the plan's optimizer bytes to the byte (they read 0.99986 and 1.00145 when the plan's
    AdamW set was the norms and embeddings alone)."""
    from paralayer import config as config_mod
    from paralayer import rehearse as R
    from paralayer.resolve.plan import resolve

    cfg = config_mod.load_config([f"recipe={recipe}", "parallel.dp=1", "parallel.ep=1", "train.optimizer=muon",
                                  "train.precision=fp32"])
    plan = resolve(cfg).to_dict()
    out = R.rehearse(cfg, plan, [0])
    assert out["ok"], out
    r = out["ranks"][0]
    assert r["memory_bytes"]["optimizer"] == r["plan_memory_bytes"]["optimizer"], r["ratios"]
