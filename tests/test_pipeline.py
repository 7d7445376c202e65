"""Pipeline parallel: parity with one process for every schedule, activation memory, the bubble.

Module-level parity: each rank splits the meta model, materialises its chunks from the seed,
runs 2 AdamW steps through :class:`PipelineRunner` (step 1's gradients, the update they make,
step 2's loss, the weights after both); the reference is the whole model in one
process on the same batch (loss = mean CE of the batch, gradient = its gradient).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from paralayer.config import ModelConfig
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.parallel import pipeline as pl
from paralayer.parallel.pipeline import timeline as tl
from paralayer.runtime.activation_memory import ActivationMemory
from tests.dist import max_rel_err, paired, run_ranks, write_tokens

# Building a model on meta imports torch's reference ops (~3–8 s, once); do it here, before the
# ranks fork, so that no rank pays it.
with torch.device("meta"):
    Transformer(ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=8, vocab_size=8))

D, LAYERS, HEADS, KV, FFN, VOCAB, SEQ = 64, 8, 4, 2, 128, 96, 32
MB, SEED, STEPS, LR = 2, 7, 2, 1e-3
TOL = 1e-5
STD = 0.2  # a wide init: at 0.02 every model's loss is ~ln(vocab), and a wrong split can match it


def _cfg(n_layers=LAYERS) -> ModelConfig:
    return ModelConfig(d_model=D, n_layers=n_layers, n_heads=HEADS, n_kv_heads=KV, ffn_hidden=FFN,
                       vocab_size=VOCAB, seq_len=SEQ, init_std=STD)


def _batch(step: int, m: int):
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, VOCAB, (m * MB, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _plan(pp: int, schedule: str, m: int, vpp: int = 1, n_layers: int = LAYERS, layout=None) -> dict:
    return {"degrees": {"pp": pp, "vpp": pl.chunks_per_rank(schedule, vpp), "tp": 1, "dp": 1, "cp": 1, "ep": 1},
            "microbatches": m, "schedule": schedule,
            "stage_layers": pl.default_stage_layers(n_layers, pp, vpp, schedule, layout)}


def _reference(m: int, steps: int = STEPS):
    torch.set_num_threads(1)
    cfg = _cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    init_weights(model, cfg, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(1, steps + 1):
        tokens, labels = _batch(step, m)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), labels, VOCAB)
        loss.backward()
        if step == 1:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _pp_worker(rank: int, world: int, schedule: str, m: int, vpp: int, steps: int, layout=None, plant=False):
    cfg = _cfg()
    plan = _plan(world, schedule, m, vpp, layout=layout)
    if plant:  # a planted error: the two middle chunks' layers run in the wrong order
        sl = plan["stage_layers"]
        sl[1], sl[2] = sl[2], sl[1]
    with torch.device("meta"):
        model = Transformer(cfg)
    chunks = pl.split_model(model, plan, rank)
    for c in chunks:
        c.to_empty(device="cpu")
        init_weights(c, cfg, SEED)
    runner = pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, VOCAB), "cpu",
                               microbatch_shape=(MB, SEQ))
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, grads = [], {}
    for step in range(1, steps + 1):
        tokens, labels = _batch(step, m)
        opt.zero_grad(set_to_none=True)
        loss = runner.step(tokens, labels)
        if step == 1:
            grads = {n: p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters()}
        losses.append(float(loss))
        opt.step()
    # numpy, not tensors: tensors would travel through the result queue as shared-memory handles
    final = {n: p.detach().numpy().copy() for c in chunks for n, p in c.named_parameters()}
    return {"losses": losses, "grads": grads, "params": final, "bubble": runner.bubble_measured,
            "timeline": runner.last_timeline}


def _rel(a, b: torch.Tensor) -> float:
    a = torch.as_tensor(a)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


_REF_CACHE: dict = {}


def _ref(m):
    if m not in _REF_CACHE:
        _REF_CACHE[m] = _reference(m)
    return _REF_CACHE[m]


CASES = [("gpipe", 2, 1, 4), ("1f1b", 2, 1, 4), ("interleaved", 2, 2, 4), ("zbv", 2, 2, 4),
         ("dualpipev", 2, 2, 4),
         ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("zbv", 4, 2, 8),
         ("dualpipev", 4, 2, 8)]


#: zero-layer chunks where the embedding or the head sit (issue 45: a balanced V): rank 0 holds the
#: embedding alone and the head alone (zbv), or the embedding alone beside a 3-layer last chunk
EMPTY_END = [("zbv", 2, 2, 4, (0, 4, 4, 0)), ("dualpipev", 2, 2, 4, (0, 3, 2, 3))]


def _pp_list(rank: int, world: int, jobs: list):
    return [_pp_worker(rank, world, schedule, m, vpp, STEPS, layout) for schedule, m, vpp, layout in jobs]


@pytest.fixture(scope="module")
def pp_runs():
    """Every case of CASES and EMPTY_END by its (schedule, pp, vpp, m, layout): the cases of one pp
    run in turn in ONE forked world (a world's first runner pays a warm-up the next ones do not)."""
    cases = [c + (None,) for c in CASES] + list(EMPTY_END)
    out = {}
    for pp in sorted({c[1] for c in cases}):
        group = [c for c in cases if c[1] == pp]
        res = run_ranks(_pp_list, pp, [(s, m, vpp, lay) for s, _, vpp, m, lay in group], timeout_s=600)
        out.update({c: [r[i] for r in res] for i, c in enumerate(group)})
    return out


@pytest.mark.parametrize("schedule,pp,vpp,m", CASES, ids=[f"{c[0]}-pp{c[1]}" for c in CASES])
def test_parity_with_one_process(pp_runs, schedule, pp, vpp, m, layout=None):
    ref_losses, ref_grads, ref_params = _ref(m)
    out = pp_runs[(schedule, pp, vpp, m, layout)]
    # every pp rank returns the same (broadcast) loss
    for r in out[1:]:
        assert r["losses"] == out[0]["losses"]
    for a, b in paired(out[0]["losses"], ref_losses):
        assert abs(a - b) / abs(b) < TOL, (out[0]["losses"], ref_losses)
    seen = set()
    for r in out:
        for n, g in r["grads"].items():
            assert n not in seen, f"{n} on two ranks"
            seen.add(n)
            assert _rel(g, ref_grads[n]) < TOL, (n, _rel(g, ref_grads[n]))
            assert _rel(r["params"][n], ref_params[n]) < TOL, n
    assert seen == set(ref_grads), set(ref_grads) ^ seen
    assert all(r["bubble"] is not None and r["bubble"] >= 0 for r in out)
    # the timeline holds every (action, microbatch, chunk) once per step
    for r in out:
        acts = {(e["action"], e["mb"], e["chunk"]) for e in r["timeline"]}
        n_chunks = pp * pl.chunks_per_rank(schedule, vpp)
        n_local_chunks = len(pl.rank_chunks(r["timeline"][0]["rank"], pp, n_chunks, schedule))
        assert len([a for a in acts if a[0] == "F"]) == m * n_local_chunks


@pytest.mark.parametrize("schedule,pp,vpp,m,layout", EMPTY_END, ids=[f"{c[0]}-{c[4]}" for c in EMPTY_END])
def test_parity_empty_end_chunks(pp_runs, schedule, pp, vpp, m, layout):
    test_parity_with_one_process(pp_runs, schedule, pp, vpp, m, layout)


def test_parity_empty_end_chunks_planted_error_fails():
    schedule, pp, vpp, m, layout = EMPTY_END[1]
    out = run_ranks(_pp_worker, pp, schedule, m, vpp, 1, layout, True)
    assert abs(out[0]["losses"][0] - _ref(m)[0][0]) > 1e-3 * abs(_ref(m)[0][0]), out[0]["losses"]


# ------------------------------------------------------------------ layout helpers
def test_layout_helpers():
    assert pl.auto_balance(6, 4) == [1, 2, 2, 1]
    assert pl.auto_balance(8, 4) == [2, 2, 2, 2]
    assert pl.auto_balance(10, 4) == [2, 3, 3, 2]
    assert pl.default_stage_layers(8, 2, 2, "interleaved") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pl.default_stage_layers(6, 2, 1, "1f1b", pp_layout=[4, 2]) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError):
        pl.default_stage_layers(6, 2, 1, "1f1b", pp_layout=[4, 3])
    assert pl.default_stage_layers(4, 2, 1, "zbv", pp_layout=[0, 2, 2, 0]) == [[], [0, 1], [2, 3], []]
    with pytest.raises(ValueError):  # only the end chunks may be empty
        pl.default_stage_layers(4, 2, 1, "zbv", pp_layout=[2, 0, 2, 0])
    assert pl.rank_chunks(0, 2, 4, "zbv") == [0, 3] and pl.rank_chunks(1, 2, 4, "zbv") == [1, 2]
    assert pl.rank_chunks(1, 2, 4, "interleaved") == [1, 3]
    with torch.device("meta"):
        model = Transformer(_cfg())
    plan = _plan(2, "zbv", 4)
    c0, c3 = pl.split_model(model, plan, 0)
    assert list(c0.layers.keys()) == ["0", "1"] and c0.tok_embeddings is not None and c0.output is None
    assert list(c3.layers.keys()) == ["6", "7"] and c3.tok_embeddings is None and c3.output is not None
    names = {n for c in pl.split_model(model, plan, 0) + pl.split_model(model, plan, 1)
             for n, _ in c.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_plot_timeline(tmp_path):
    rows = [[{"action": "F", "mb": 0, "chunk": 0, "start": 0.0, "end": 1.0},
             {"action": "B", "mb": 0, "chunk": 0, "start": 3.0, "end": 5.0}],
            [{"action": "F", "mb": 0, "chunk": 1, "start": 1.0, "end": 2.0},
             {"action": "W", "mb": 0, "chunk": 1, "start": 2.0, "end": 3.0}]]
    path = tl.plot_timeline(rows, str(tmp_path / "t.png"))
    assert os.path.getsize(path) > 1000


# ------------------------------------------------------------------ activation memory
def _mem_worker(rank: int, world: int, schedule: str, m: int, steps: int = 1, vpp: int = 1, n_layers: int = 4):
    cfg = _cfg(n_layers)
    plan = _plan(world, schedule, m, vpp, n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(cfg)
    chunks = pl.split_model(model, plan, rank)
    for c in chunks:
        c.to_empty(device="cpu")
        init_weights(c, cfg, SEED)
    runner = pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, VOCAB), "cpu",
                               measure=False)
    tokens, labels = _batch(1, m)
    params = [p for c in chunks for p in c.parameters()]
    peaks, lives = [], []
    # the first step runs torch's metadata inference: it must not leave activations behind either
    with ActivationMemory(params + [tokens, labels]) as mem:
        for _ in range(steps):
            mem.reset_peak()
            runner.step(tokens, labels)
            peaks.append(mem.peak_bytes)
            lives.append(mem.live)
    return peaks[-1], max(lives), peaks


def _mem_list(rank: int, world: int, jobs: list):
    """_mem_worker for every argument tuple of ``jobs``, in turn in this world (one fork, not one each)."""
    return [_mem_worker(rank, world, *job) for job in jobs]


def test_activation_memory_gpipe_grows_1f1b_flat():
    p = 2
    peaks = {}
    jobs = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (p, 2 * p, 4 * p)]
    out = run_ranks(_mem_list, p, jobs)
    for i, job in enumerate(jobs):
        res = [r[i] for r in out]
        peaks[job] = [r[0] for r in res]
        assert all(r[1] == 0 for r in res), "saved activations leaked past the step"
    for stage in range(p):
        g = [peaks[("gpipe", m)][stage] for m in (p, 2 * p, 4 * p)]
        # GPipe keeps every microbatch: peak ∝ m
        assert g[1] / g[0] == pytest.approx(2, rel=0.05) and g[2] / g[0] == pytest.approx(4, rel=0.05), g
        f = [peaks[("1f1b", m)][stage] for m in (p, 2 * p, 4 * p)]
        assert max(f) / min(f) <= 1.05, f
    # 1F1B: stage r holds p − r microbatches in flight
    f0, f1 = peaks[("1f1b", 4 * p)]
    assert f0 > f1
    # the plan's activation model predicts every stage within 10%
    for (schedule, m), measured in peaks.items():
        pred = _predicted_activations(schedule, p, m)
        for r, (got, want) in enumerate(paired(measured, pred)):
            assert abs(got - want) <= 0.10 * got, (schedule, m, r, got, want)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev"])
def test_no_activations_outlive_a_step(schedule):
    """Every saved tensor is freed by the end of each step, and the peak is the same every step,
    the first (with torch's metadata inference) included — also for the split input/weight
    backward of the V schedules. (This caught ActivationMemory holding saved OUTPUTS with their
    grad_fn: a cycle through autograd's C++ nodes that kept the bytes counted forever.)"""
    p, m = 2, 4
    out = run_ranks(_mem_list, p, [(schedule, m, 3), (schedule, 2 * m)])
    for rank, (_, live, peaks) in enumerate(r[0] for r in out):
        assert live == 0, (schedule, rank, live)
        assert peaks[0] == peaks[1] == peaks[2], (schedule, rank, peaks)
    # the plan's in-flight count for the V schedules (torch's orders: ZB-V 2p, DualPipeV 2p + 1
    # chunk-microbatches on every rank) within 10% of the measured peak
    for rank, (peak, _, _) in enumerate(r[1] for r in out):
        want = _predicted_activations(schedule, p, 2 * m)[rank]
        assert abs(peak - want) <= 0.10 * peak, (schedule, rank, peak, want)


def _predicted_activations(schedule: str, p: int, m: int, vpp: int = 1, n_layers: int = 4) -> list[int]:
    from paralayer.config import load_config
    from paralayer.resolve import memory, rules

    cfg = load_config(["parallel.tp=1", f"model.d_model={D}", f"parallel.vpp={vpp}",
                       f"model.n_layers={n_layers}", f"model.n_heads={HEADS}", f"model.n_kv_heads={KV}",
                       f"model.ffn_hidden={FFN}", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
                       f"parallel.pp={p}", "parallel.dp=1", f"parallel.schedule={schedule}",
                       f"train.micro_batch={MB}", f"train.global_batch={MB * m}", "train.precision=fp32",
                       "cluster.device=cpu"])
    lay = rules.check(cfg)
    return [memory.rank_memory(cfg, lay, r)[3] for r in range(p)]


def test_activation_memory_matches_plan_pp4():
    p, m = 4, 8
    measured = [r[0] for r in run_ranks(_mem_worker, p, "1f1b", m)]
    for r, (got, want) in enumerate(paired(measured, _predicted_activations("1f1b", p, m))):
        assert abs(got - want) <= 0.10 * got, (r, got, want)


def test_activation_memory_interleaved_every_rank():
    """torch's interleaved order: rank r holds (v−1)·p + 2·(p−1−r) + 1 chunk-microbatches at its
    peak, so the last rank holds a whole round of its first chunk (Megatron's (p − r)-scaled
    count, exact only on the first rank, planned the last one at 1.25 where it holds 1.5 sets)."""
    p, v, m = 2, 2, 4
    measured = [r[0] for r in run_ranks(_mem_worker, p, "interleaved", m, 1, v, 8)]
    for r, (got, want) in enumerate(paired(measured, _predicted_activations("interleaved", p, m, v, 8))):
        assert abs(got - want) <= 0.05 * got, (r, got, want)


# ------------------------------------------------------------------ end to end through train()
E2E_SEQ = 16
E2E_BASE = ["parallel.tp=1",
            "model.d_model=32", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48",
            "model.vocab_size=64", f"model.seq_len={E2E_SEQ}", "train.global_batch=16", "train.micro_batch=2",
            "train.steps=2", "train.lr=3e-3", "train.warmup_steps=1", "train.precision=fp32", "train.threads=1",
            "data.format=tokens", "data.shuffle=false", "logging.wandb.mode=disabled", "logging.progress=false",
            "checkpoint.every=0", "cluster.device=cpu", "cluster.peak_tflops=1.0", f"model.init_std={STD}"]


def _e2e_data(tmp) -> str:
    return write_tokens(os.path.join(str(tmp), "tokens.jsonl"), 128, E2E_SEQ, 64, keep_existing=True)


def _e2e_rank(rank, world, cfg, plan):
    from paralayer.runtime.train import train

    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "bubble_measured": r.get("bubble_measured")}
            for r in train(cfg, plan)]


def _e2e_list(rank, world, jobs):
    return [_e2e_rank(rank, world, cfg, plan) for cfg, plan in jobs]


def _e2e_many(tmp, layouts: list) -> list[list[list[dict]]]:
    """Each layout's records by rank; the layouts (one world size) train in turn in ONE forked world
    (a world's first train() pays ~0.75 CPU-s per rank of warm-up that a second one does not)."""
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    cfgs = [load_config(E2E_BASE + [f"data.path={_e2e_data(tmp)}"] + layout) for layout in layouts]
    jobs = [(cfg, resolve(cfg).to_dict()) for cfg in cfgs]
    assert not [p["errors"] for _, p in jobs if p["errors"]]
    (world,) = {plan["world_size"] for _, plan in jobs}
    out = run_ranks(_e2e_list, world, jobs, timeout_s=600)
    return [[out[r][i] for r in range(world)] for i in range(len(jobs))]


def _e2e(tmp, layout: list[str]) -> list[list[dict]]:
    return _e2e_many(tmp, [layout])[0]


MOE_E2E = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=0",
           "model.moe.capacity_factor=null"]
_E2E_REF: dict = {}


def _e2e_ref(tmp, moe: bool = False):
    """The one-rank records of the dense model (or the MoE one): both computed once, in one world."""
    if not _E2E_REF:
        dense, with_moe = _e2e_many(tmp, [["parallel.dp=1"], MOE_E2E + ["parallel.dp=1"]])
        _E2E_REF.update(dense=dense[0], moe=with_moe[0])
    return _E2E_REF["moe" if moe else "dense"]


def _assert_e2e_parity(out: list, ref: list, what) -> None:
    """Every rank's records match the one-rank run's, step for step: loss and grad norm to 1e-5
    relative (the counts must match and be non-zero)."""
    for recs in out:
        for key in ("loss", "grad_norm"):
            got, want = [r[key] for r in recs], [r[key] for r in ref]
            assert max_rel_err(got, want) <= 1e-5, (what, key, got, want)


#: The module-level matrix above runs every schedule at pp 2 and 4 (per-parameter grads); through
#: train() every schedule runs once, at pp 4 (pp 2 through train() is in the combination suite,
#: tests/test_combinations.py, and the composed cases below): one matrix, not the same one twice.
E2E_CASES = [(s, 4) for s in ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")]
#: every 4-rank layout of this file's train() tests, by test id: they train in turn in one world
E2E_WORLD4 = {
    **{f"{s}-pp{pp}": ["parallel.dp=1", f"parallel.pp={pp}", f"parallel.vpp={2 if s == 'interleaved' else 1}",
                       f"parallel.schedule={s}"] for s, pp in E2E_CASES},
    "pp2-dp2-zero3-interleaved": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=3",
                                  "parallel.schedule=interleaved"],
    # the V schedules with tensor + sequence parallel (view outputs, sharded loss), and with experts
    # over ep (the MoE all-to-all under the V)
    "zbv-tp2": ["parallel.dp=1", "parallel.tp=2", "parallel.pp=2", "parallel.schedule=zbv"],
    "dualpipev-moe-ep2": MOE_E2E + ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.schedule=dualpipev"],
}


@pytest.fixture(scope="module")
def e2e4(tmp_path_factory):
    """Every layout of E2E_WORLD4: its records by rank."""
    tmp = tmp_path_factory.getbasetemp()
    return dict(zip(E2E_WORLD4, _e2e_many(tmp, list(E2E_WORLD4.values()))))


@pytest.mark.parametrize("schedule,pp", E2E_CASES, ids=[f"{s}-pp{pp}" for s, pp in E2E_CASES])
def test_train_parity(tmp_path_factory, e2e4, schedule, pp):
    tmp = tmp_path_factory.getbasetemp()
    ref = _e2e_ref(tmp)
    out = e2e4[f"{schedule}-pp{pp}"]
    _assert_e2e_parity(out, ref, (schedule, pp))
    for recs in out:
        assert all(r["bubble_measured"] is not None and r["bubble_measured"] >= 0 for r in recs)


def test_train_parity_empty_end_chunks(tmp_path_factory):
    """Through train(): dualpipev with pp rank 0 holding the embedding alone and the head alone (issue
    45's balanced V), full recompute. (By hand also dp2·ZeRO-2: loss exact, grad norm 7.9e-8.)"""
    tmp = tmp_path_factory.getbasetemp()
    out = _e2e(tmp, ["parallel.dp=1", "parallel.pp=2", "parallel.schedule=dualpipev", "parallel.pp_layout=[0,4,4,0]",
                     "parallel.recompute=full"])
    _assert_e2e_parity(out, _e2e_ref(tmp), "dualpipev-[0,4,4,0]")


def test_train_parity_pp2_tp2_dp2(tmp_path_factory):
    tmp = tmp_path_factory.getbasetemp()
    ref = _e2e_ref(tmp)
    out = _e2e(tmp, ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.schedule=1f1b"])
    _assert_e2e_parity(out, ref, "pp2-tp2-dp2")


# ------------------------------------------------------------------ MoE aux loss through the pipe
AUX = 0.1


def _moe_cfg() -> ModelConfig:
    cfg = _cfg(4)
    cfg.moe.num_experts = 4
    cfg.moe.top_k = 2
    return cfg


def _moe_worker(rank: int, world: int, m: int):
    cfg = _moe_cfg()
    plan = _plan(world, "1f1b", m, 1, n_layers=4)
    with torch.device("meta"):
        model = Transformer(cfg)
    chunks = pl.split_model(model, plan, rank)
    for c in chunks:
        c.to_empty(device="cpu")
        init_weights(c, cfg, SEED)
    runner = pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, VOCAB), "cpu",
                               aux_loss_coef=AUX)
    tokens, labels = _batch(1, m)
    loss = runner.step(tokens, labels)
    return float(loss), {n: p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters()}


def test_moe_aux_loss_gradient_through_pipeline():
    m = 4
    cfg = _moe_cfg()
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    init_weights(model, cfg, SEED)
    tokens, labels = _batch(1, m)
    ce_sum = 0.0
    for tk, lb in zip(tokens.chunk(m), labels.chunk(m)):
        ce = lm_loss(model(tk), lb, VOCAB)
        ((ce + AUX * model.aux_loss()) / m).backward()
        ce_sum += ce.item() / m
    out = run_ranks(_moe_worker, 2, m)
    assert abs(out[0][0] - ce_sum) <= 1e-5 * ce_sum
    for _, grads in out:
        for n, g in grads.items():
            assert _rel(g, dict(model.named_parameters())[n].grad) < 1e-5, n


def test_train_parity_pp2_dp2_zero3_interleaved(tmp_path_factory, e2e4):
    tmp = tmp_path_factory.getbasetemp()
    _assert_e2e_parity(e2e4["pp2-dp2-zero3-interleaved"], _e2e_ref(tmp), "pp2-dp2-zero3-interleaved")


# ------------------------------------------------------------------ zero-bubble schedules with tp+SP and MoE
@pytest.mark.parametrize("case", ["zbv-tp2", "dualpipev-moe-ep2"])
def test_train_parity_v_schedules_compose(tmp_path_factory, e2e4, case):
    """The V schedules with tensor + sequence parallel, and with experts over ep, match one rank."""
    tmp = tmp_path_factory.getbasetemp()
    ref = _e2e_ref(tmp, moe=case.endswith("moe-ep2"))
    _assert_e2e_parity(e2e4[case], ref, (case, E2E_WORLD4[case]))
