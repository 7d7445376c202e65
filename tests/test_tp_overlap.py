"""parallel.tp_overlap (paralayer/parallel/tensor/tp_overlap.py): the sequence-parallel all-gathers and
reduce-scatters decomposed into the GEMMs over the tp ring. Same numbers as one process, the
traffic and saved activations the plan says."""
from __future__ import annotations

import pytest
import torch

from paralayer.config import MoEConfig
from tests.dist import max_rel_err, run_ranks
from tests.test_tensor import B, S, _tp_worker, batches, reference, tiny, tp_model

torch.set_num_threads(1)


CASES = {
    "tp2": (tiny(), 2),
    "tp4": (tiny(), 4),
    "tp2_gqa": (tiny(n_kv_heads=2), 2),
    "tp2_moe": (tiny(moe=MoEConfig(num_experts=4, top_k=2)), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_matches_one_process(case):
    """2 AdamW steps: every loss and the first step's every gradient equal one process's (the second
    step's loss checks the update those gradients make)."""
    cfg, tp = CASES[case]
    data = batches(cfg, 2)
    ref_losses, ref_grads = reference(cfg, data)
    out = run_ranks(_tp_worker, tp, cfg, True, data, True)  # sequence parallel, overlap
    losses, grads = out[0]["losses"], out[0]["grads"]
    assert all(o["losses"] == losses for o in out), "tp ranks disagree on the loss"
    loss_err = max_rel_err(losses, ref_losses)
    grad_err = 0.0
    for name, g_ref in ref_grads.items():
        g = torch.from_numpy(grads[name])[: g_ref.shape[0]]  # padded vocab rows/cols of the embeddings
        if g.shape != g_ref.shape:
            g = torch.from_numpy(grads[name])[:, : g_ref.shape[1]]
        grad_err = max(grad_err, ((g - g_ref).abs().max() / g_ref.abs().max()).item())
    print(f"[{case}] max rel loss err {loss_err:.2e}, max rel grad err {grad_err:.2e}")
    # the first step (loss, every gradient) to 1e-5; the later AdamW step to 1e-4, as in
    # test_tensor.test_model_parity (init std 0.2: measured up to 3e-5 by step 5, tp2_moe)
    assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]) and grad_err <= 1e-5
    assert loss_err <= 1e-4


# ------------------------------------------------------------------ traffic against the plan
def _traffic_worker(rank, world, n_layers_list, moe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from paralayer.parallel.tensor import loss_parallel_ctx, tp_loss, tp_overlap

    sent = {"n": 0, "bytes": 0}
    start = tp_overlap._Ring.start

    def counting(self, send, recv):
        sent["n"] += 1
        sent["bytes"] += send.numel() * send.element_size()
        return start(self, send, recv)

    tp_overlap._Ring.start = counting
    out = []
    for n_layers in n_layers_list:
        cfg = tiny(n_layers=n_layers, moe=MoEConfig(num_experts=4, top_k=2, every=1) if moe else MoEConfig())
        tokens, labels = batches(cfg, 1)[0]
        model = tp_model(init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"], cfg, True, True)
        sent["n"] = sent["bytes"] = 0
        plain = CommDebugMode()
        with loss_parallel_ctx(True), plain:
            tp_loss(model(tokens), labels, cfg.vocab_size).backward()
        counts = {str(k).split(".")[-1]: v for k, v in plain.get_comm_counts().items()}
        out.append((dict(sent), counts))
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_ring_traffic_per_layer_matches_plan(moe):
    """Sends and bytes of the fused rings per layer (2 layers minus 1), and the MoE block's plain
    collectives, equal cost.comm's tp entry for the same layer."""
    from paralayer.config import load_config
    from paralayer.resolve import cost, rules

    tp = 2
    (s1, c1), (s2, c2) = run_ranks(_traffic_worker, tp, (1, 2), moe)[0]
    sends, sent_bytes = s2["n"] - s1["n"], s2["bytes"] - s1["bytes"]
    # all_reduce: the SP norms' weight grads (h elements per norm), left out of every tp figure
    plain = sum(v for k, v in c2.items() if k != "all_reduce") - sum(v for k, v in c1.items() if k != "all_reduce")
    ov = ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=96",
          "model.vocab_size=61", f"model.seq_len={S}", f"parallel.tp={tp}", "parallel.dp=1",
          "parallel.tp_overlap=true", f"train.global_batch={B}", f"train.micro_batch={B}", "train.precision=fp32"]
    if moe:
        ov += ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.every=1"]
    # per layer: the plan at 2 layers minus 1 (the embedding's, head's and loss's collectives cancel)
    e1, e2 = (cost.comm(load_config(ov + [f"model.n_layers={n}"]), rules.check(load_config(ov + [f"model.n_layers={n}"])))["tp"]
              for n in (1, 2))
    e = {k: e2.get(k, 0) - e1.get(k, 0) for k in ("count_per_step", "bytes_per_step", "plain_bytes_per_step")}
    # less the layer's two SP norm-grad all-reduces (fp32, h each), which the plan counts too
    mm = rules.check(load_config(ov + ["model.n_layers=1"])).microbatches
    e["count_per_step"] -= 2 * mm
    e["bytes_per_step"] -= 2 * 64 * 4 * mm
    rings = cost.TP_RINGS_MOE if moe else cost.TP_RINGS_DENSE
    plain_plan = sum(cost.TP_PLAIN_MOE) if moe else 0
    print(f"[moe={moe}] per layer: {sends} ring sends, {sent_bytes} B; plain collectives {plain}; "
          f"plan {e['count_per_step']} sends+plain, {e['bytes_per_step']} B")
    assert sends == sum(rings) * (tp - 1)
    assert plain == plain_plan
    assert sends + plain == e["count_per_step"]
    assert sent_bytes + e.get("plain_bytes_per_step", 0) == e["bytes_per_step"]


# ------------------------------------------------------------------ through train()
def _train_list(rank, world, jobs):
    """Train every (cfg, plan) of ``jobs`` in turn in this world: [(loss, grad_norm) per step] each."""
    from paralayer.runtime.train import train

    return [[(r["loss"], r["grad_norm"]) for r in train(cfg, plan)] for cfg, plan in jobs]


BASE = ["recipe=tiny", "model.n_layers=4", "model.seq_len=32", "model.n_kv_heads=2", "train.steps=2",
        "model.init_std=0.2",
        "train.global_batch=4", "train.micro_batch=1", "train.precision=fp32", "logging.wandb.mode=disabled"]
#: the layouts, all on 4 ranks: ONE forked world trains them in turn (a world's first train() pays
#: ~0.75 CPU-s per rank of warm-up that a second one does not)
LAYOUTS = {
    "tp2-dp2-zero3-full": ["parallel.tp=2", "parallel.dp=2", "parallel.zero=3", "parallel.recompute=full"],
    "tp2-pp2-1f1b-selective": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.schedule=1f1b",
                               "parallel.recompute=selective"],
    "tp2-pp2-zbv": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "parallel.schedule=zbv"],
}


def _job(tmp, layout):
    from tests.dist import cfg_and_plan

    return cfg_and_plan(BASE + [f"run.dir={tmp}", "logging.progress=false", "checkpoint.every=0"] + layout)


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    """The one-rank reference, and each layout's plan and records by rank."""
    tmp = tmp_path_factory.mktemp("overlap")
    ref = run_ranks(_train_list, 1, [_job(tmp / "ref", ["parallel.tp=1", "parallel.dp=1"])], timeout_s=300)[0][0]
    jobs = [_job(tmp / name, lay + ["parallel.tp_overlap=true"]) for name, lay in LAYOUTS.items()]
    (world,) = {plan["world_size"] for _, plan in jobs}
    out = run_ranks(_train_list, world, jobs, timeout_s=600)
    return ref, {name: (jobs[i][1], [out[r][i] for r in range(world)]) for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_with_overlap_matches_one_rank(overlap_runs, layout):
    ref, runs = overlap_runs
    plan, out = runs[layout]
    assert plan["tp_overlap"] is True
    for recs in out:
        # loss 1e-5; grad norm 3e-5 (init std 0.2: measured 1.8e-5 by step 3 in all three layouts;
        # 2 steps: the gradients and the update they make)
        for i, what, tol in ((0, "loss", 1e-5), (1, "grad_norm", 3e-5)):
            err = max_rel_err([r[i] for r in recs], [r[i] for r in ref])
            assert err <= tol, (LAYOUTS[layout], what, recs, ref)


# ------------------------------------------------------------------ the launcher's front door
def test_tp_overlap_without_sequence_parallel_is_a_clear_error():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "launch.py", "recipe=tiny", "parallel.tp=2", "parallel.tp_overlap=true",
                          "parallel.sequence_parallel=false", "--dry-run"], cwd=repo, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "parallel.tp_overlap" in out.stderr and "sequence_parallel=true" in out.stderr
    assert "Traceback" not in out.stderr
    ok = subprocess.run([sys.executable, "launch.py", "recipe=tiny", "parallel.tp=1", "parallel.tp_overlap=true",
                         "--dry-run", "--json"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    import json

    plan = json.loads(ok.stdout)
    assert plan["tp_overlap"] is False
    assert any(w["field"] == "parallel.tp_overlap" for w in plan["warnings"])
