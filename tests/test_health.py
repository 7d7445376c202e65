"""Run health (issue 30) on forked gloo ranks: profiler traces, the straggler named, loss spikes
and non-finite steps (skip, rollback, stop, warn), and goodput across a resume. The hang test is
tests/test_health_hang.py (it needs the launcher)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401 - imported once here, not in every forked rank (AdamW imports it: ~1.7 s)
import torch.distributed.checkpoint  # noqa: F401
import torch.profiler  # noqa: F401

import paralayer.runtime.train  # noqa: F401
from tests.dist import cfg_and_plan, run_ranks

BASE = ["recipe=tiny", "parallel.tp=1", "model.n_layers=2", "model.seq_len=32", "model.d_model=32",
        "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.init_std=0.2", "train.global_batch=4",
        "train.micro_batch=2", "logging.wandb.mode=disabled", "logging.progress=false", "train.warmup_steps=0"]


def _train(rank, world, overrides, run_dir, spec=None):
    """train() on this rank (with the fault hook ``spec``): [(step, loss)] and the exception text."""
    from paralayer.runtime import train as T
    from tests.fault_hook import make_hooks

    cfg, plan = cfg_and_plan(BASE + [f"parallel.dp={world}"] + overrides)
    hooks = make_hooks(T, spec) if spec else None
    try:
        recs = T.train(cfg, plan, run_dir, hooks=hooks)
    except (T.NonFiniteLoss, T.stab_mod.LossSpike) as exc:
        return {"error": str(exc)}
    return {"losses": [(r["step"], r["loss"]) for r in recs],
            "timing": [(r.get("slowest_rank"), r.get("slowest_host"), r.get("rank_time_spread")) for r in recs]}


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ profiler
def _trace_names(path) -> set[str]:
    return {e.get("name", "") for e in json.loads(Path(path).read_text())["traceEvents"]}


def test_profile_writes_trace_per_chosen_rank_with_named_ranges_and_loss_unchanged(tmp_path):
    prof = ["logging.profile.start=2", "logging.profile.steps=1", "logging.profile.ranks=[1]",
            "logging.profile.memory=true", "train.steps=3"]
    got = run_ranks(_train, 2, prof, str(tmp_path / "dp"))
    want = run_ranks(_train, 2, ["train.steps=3"], str(tmp_path / "plain"))
    assert got[0]["losses"] == want[0]["losses"] and len(want[0]["losses"]) == 3  # bitwise
    assert not (tmp_path / "dp" / "profile" / "rank-0.json").exists()
    names = _trace_names(tmp_path / "dp" / "profile" / "rank-1.json")
    for n in ("forward", "backward", "optimizer", "comm.dp_cp.grad_reduce", "comm.dp_cp.loss_all_reduce"):
        assert n in names, (n, sorted(names)[:50])
    assert "[memory]" in names  # CPU: the profiler's memory events
    assert not (tmp_path / "plain" / "profile").exists()
    pp = ["parallel.pp=2", "parallel.dp=1", "train.steps=2", "logging.profile.start=1", "logging.profile.ranks=null"]
    run_ranks(_train_pp, 2, pp, str(tmp_path / "pp"))
    names = _trace_names(tmp_path / "pp" / "profile" / "rank-1.json")
    assert {"pipeline.F.mb0.chunk1", "pipeline.B.mb1.chunk1", "comm.pp.loss_broadcast"} <= names, sorted(names)[:80]


def _train_pp(rank, world, overrides, run_dir):
    from paralayer.runtime import train as T

    cfg, plan = cfg_and_plan(BASE + overrides)
    return [r["loss"] for r in T.train(cfg, plan, run_dir)]


# ------------------------------------------------------------------ stragglers
LAYOUTS = {"zero0": ["parallel.zero=0"], "zero2": ["parallel.zero=2"], "zero3": ["parallel.zero=3"],
           "tp2": ["parallel.tp=2", "parallel.dp=1"], "pp2": ["parallel.pp=2", "parallel.dp=1"]}


#: where the slowed rank's 0.2 s lands: before the forward (every layout), or inside the backward
#: (the peer then waits in tp's backward collectives, FSDP2's reduce-scatter, the pipeline's
#: gradient receive: the layouts whose backward has collectives of their own)
CASES = [(lay, "slow") for lay in LAYOUTS] + [(lay, "slowbw") for lay in ("zero3", "tp2", "pp2")]
#: under tp the peers meet in every layer's collectives, each a chance for a loaded machine to
#: stall the healthy rank and charge the wait to it: 0.2 s was outweighed at step 3 in two local
#: fresh-clone runs (7 Dec: [1, 1, 0, 1, 1]; a full collection of the inherited heap, now frozen in
#: tests/dist.py, fits that step); 0.5 s keeps the slowed rank the one waited for
PAUSE = {"tp2": 0.5}


@pytest.mark.parametrize("layout,kind", CASES)
def test_slowed_rank_is_named_in_metrics_and_on_the_console(tmp_path, capfd, layout, kind):
    """Under ZeRO-2/3 the peer waits in FSDP2's all-gather for the slowed rank: that time must be
    waiting (parallel/collective_timing.py), or both ranks look equally busy."""
    out = run_ranks(_train, 2, ["train.steps=5", "model.seq_len=16"] + LAYOUTS[layout], str(tmp_path),
                    f"{kind}:1:1:{PAUSE.get(layout, 0.2)}")
    err = capfd.readouterr()
    recs = _lines(tmp_path)
    named = [r["slowest_rank"] for r in recs]
    # steps 1-2 (lazy init on both ranks: FSDP's first all-gathers, DTensor's sharding caches, the
    # pipeline's schedule; on a loaded machine it reaches into step 2) may name either rank outside
    # plain data parallel; from step 3 on the slowed rank is named every step
    warm = 0 if layout == "zero0" else 2
    assert named[warm:] == [1] * (5 - warm), named
    # (warm-up steps: the 0.2 s sleep is a smaller share of them)
    # the median step: one step of a loaded machine read 1.16 under tp2 (6 Dec CI) beside 1.60 and 1.28
    spreads = sorted(r["rank_time_spread"] for r in recs[max(warm, 1):])
    assert spreads[len(spreads) // 2] > 1.2 and spreads[0] > 1.05, [r["rank_time_spread"] for r in recs]
    assert recs[0]["slowest_host"] == os.uname().nodename
    assert out[0]["timing"] == out[1]["timing"]  # every rank has the gathered fields
    warned = [x for x in (err.out + err.err).splitlines() if "straggler: rank 1" in x]
    assert len(warned) == 1 and "slow part: compute" in warned[0] and "3 logged steps in a row" in warned[0], warned


# ------------------------------------------------------------------ spikes and non-finite steps
CKPT = ["train.steps=6", "checkpoint.every=2"]
SPIKE = ["train.spike.window=3", "train.spike.threshold_sigma=3"]


def test_nonfinite_rollback_skips_the_batches_and_is_reproducible(tmp_path):
    args = CKPT + ["train.on_nonfinite=rollback", "train.rollback_skip_margin=1"]
    a = run_ranks(_train, 1, args, str(tmp_path / "a"), "nan1:0:5")[0]
    b = run_ranks(_train, 1, args, str(tmp_path / "b"), "nan1:0:5")[0]
    assert a["losses"] == b["losses"]  # bitwise: the same command twice
    assert [s for s, _ in a["losses"]] == [1, 2, 3, 4, 5, 6]
    lines = _lines(tmp_path / "a")
    events = [x for x in lines if x.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["step"] == 5 and events[0]["from_step"] == 4
    assert events[0]["skipped_batches"] == [5, 6]  # the bad step's batch + a margin of 1
    assert [x["step"] for x in lines if "event" not in x] == [1, 2, 3, 4, 5, 6]  # each step once
    plain = run_ranks(_train, 1, ["train.steps=6"], str(tmp_path / "p"))[0]["losses"]
    assert a["losses"][:4] == plain[:4] and a["losses"][4] != plain[4]  # step 5 read batch 7


def test_spike_actions(tmp_path):
    spec = "spike1:0:5"
    six = ["train.steps=6"]
    warn = run_ranks(_train, 1, six + SPIKE, str(tmp_path / "w"), spec)[0]["losses"]
    assert [s for s, _ in warn] == [1, 2, 3, 4, 5, 6] and warn[4][1] > 3 * warn[3][1]  # logged, trained on
    skip = run_ranks(_train, 1, six + SPIKE + ["train.spike.action=skip"], str(tmp_path / "s"), spec)[0]
    assert [s for s, _ in skip["losses"]] == [1, 2, 3, 4, 6]
    stop = run_ranks(_train, 1, six + SPIKE + ["train.spike.action=stop"], str(tmp_path / "x"), spec)[0]
    assert "step 5: loss spike" in stop["error"] and [x["step"] for x in _lines(tmp_path / "x")] == [1, 2, 3, 4]
    rb = run_ranks(_train, 1, CKPT + SPIKE + ["train.spike.action=rollback"], str(tmp_path / "r"), spec)[0]
    assert [s for s, _ in rb["losses"]] == [1, 2, 3, 4, 5, 6] and rb["losses"][4][1] < 2 * rb["losses"][3][1]
    assert [x["skipped_batches"] for x in _lines(tmp_path / "r") if "event" in x] == [[5]]


def test_nonfinite_skip_and_stop(tmp_path):
    skip = run_ranks(_train, 1, ["train.steps=4", "train.on_nonfinite=skip"], str(tmp_path / "s"), "nan:0:2")[0]
    assert [s for s, _ in skip["losses"]] == [1, 3, 4]
    stop = run_ranks(_train, 1, ["train.steps=4", "train.on_nonfinite=stop", "train.skip_nonfinite=true"],
                     str(tmp_path / "x"), "nan:0:2")[0]
    assert "step 2: loss is nan" in stop["error"]  # on_nonfinite wins over the older flag
    none = run_ranks(_train, 1, ["train.steps=4", "train.on_nonfinite=rollback"], str(tmp_path / "n"), "nan:0:2")[0]
    assert "no verified checkpoint before this step" in none["error"]


# ------------------------------------------------------------------ goodput
def test_goodput_sums_the_attempts_of_a_resumed_run(tmp_path, capfd):
    import shutil

    run_ranks(_train, 1, ["train.steps=6", "train.stop_at_step=3", "checkpoint.every=2"], str(tmp_path))
    first = json.loads((tmp_path / "goodput.json").read_text())
    assert len(first["attempts"]) == 1 and first["attempts"][0]["unsaved"] == {}  # saved at its last step
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000003")  # as if the attempt died before that save
    first["attempts"][0]["unsaved"] = {"3": first["attempts"][0]["buckets_s"]["steps"] / 3}
    (tmp_path / "goodput.json").write_text(json.dumps(first))
    run_ranks(_train, 1, ["train.steps=6", "checkpoint.every=2", "train.resume=auto"], str(tmp_path))
    g = json.loads((tmp_path / "goodput.json").read_text())
    t = g["totals"]
    assert t["goodput_attempts"] == 2 and [a["start_step"] for a in g["attempts"]] == [1, 3]
    step3 = first["attempts"][0]["unsaved"]["3"]
    assert g["attempts"][0]["lost_s"] == pytest.approx(step3)  # step 3 ran again after the resume from step 2
    buckets = sum(v for k, v in t.items() if k.endswith("_s") and k != "goodput_wall_s")
    assert buckets == pytest.approx(t["goodput_wall_s"], rel=1e-6)
    assert 0 < t["goodput"] < 1 and t["goodput_restart_s"] > step3 and t["goodput_checkpoint_s"] > 0
    assert "paralayer: goodput" in capfd.readouterr().out


def _train_recording_goodput(rank, world, overrides, run_dir, spec=None):
    """_train, recording each (step, seconds, counted) the runtime hands goodput."""
    from paralayer.metrics import goodput

    calls, real = [], goodput.Goodput.step

    def step(self, step, seconds, counted=True):
        calls.append((step, seconds, counted))
        return real(self, step, seconds, counted)

    goodput.Goodput.step = step
    try:
        return dict(_train(rank, world, overrides, run_dir, spec), calls=calls)
    finally:
        goodput.Goodput.step = real


def test_goodput_puts_a_skipped_step_in_skipped(tmp_path):
    """train.on_nonfinite=skip with step 2's loss NaN: goodput.json's ``skipped`` is that step's
    time (and only it), ``steps`` the three counted steps' step_time_s of metrics.jsonl, and the
    buckets add up to the wall time."""
    out = run_ranks(_train_recording_goodput, 1, ["train.steps=4", "train.on_nonfinite=skip"], str(tmp_path),
                    "nan:0:2")[0]
    assert [(s, c) for s, _, c in out["calls"]] == [(1, True), (2, False), (3, True), (4, True)]
    skipped = out["calls"][1][1]
    t = json.loads((tmp_path / "goodput.json").read_text())["totals"]
    assert skipped > 0 and t["goodput_skipped_s"] == skipped, (t, out["calls"])
    lines = [x for x in _lines(tmp_path) if "event" not in x]
    assert [x["step"] for x in lines] == [1, 3, 4]
    assert t["goodput_steps_s"] == pytest.approx(sum(x["step_time_s"] for x in lines), rel=1e-12)
    buckets = sum(v for k, v in t.items() if k.endswith("_s") and k != "goodput_wall_s")
    assert buckets == pytest.approx(t["goodput_wall_s"], rel=1e-6)
    assert t["goodput"] == pytest.approx(t["goodput_steps_s"] / t["goodput_wall_s"], rel=1e-12)


def test_hang_diagnosis_names_missing_behind_or_idle_ranks(tmp_path):
    """diagnose() on written reports: a rank with no report, else one behind, else one not inside
    the collective the others wait in."""
    from paralayer.runtime.health.watchdog import diagnose

    def write(rank, step, inside=True):
        last = {"axis": "dp_cp", "op": "grad_reduce", "step": step, "phase": "reduce", "microbatch": None}
        if not inside:
            last["done"] = True
        where = {"rank": rank, "step": step, "phase": "reduce", "last_collective": last}
        (tmp_path / f"rank-{rank}.txt").write_text(f"header\nwhere: {json.dumps(where)}\nstacks\n")

    write(0, 4)
    write(2, 4)
    assert "rank 1 never entered the collective the others wait in (dp_cp grad_reduce, step 4" in \
        diagnose(str(tmp_path), 3)
    write(1, 3)
    assert "rank 1 never entered" in diagnose(str(tmp_path), 3)
    write(1, 4, inside=False)
    assert "rank 1 never entered" in diagnose(str(tmp_path), 3)
    write(1, 4)
    assert "no rank is behind" in diagnose(str(tmp_path), 3)


def _stuck_rank(run_dir):
    from paralayer.parallel.comm_trace import CommTrace
    from paralayer.runtime.health.watchdog import Watchdog

    trace = CommTrace(rank=0)
    trace.new_step(7)
    wd = Watchdog(0.3, run_dir, 0, 2, trace, announce=True, grace_s=0.2)
    wd.beat(6)
    with trace.collective("dp_cp", "grad_reduce"):
        import time

        time.sleep(30)  # the peer never comes


def test_watchdog_without_the_launcher_reports_and_exits(tmp_path):
    """The rank side alone (as under SLURM, where srun --kill-on-bad-exit ends the job step): the
    report, the diagnosis line (printed by the lowest rank that wrote one) in error.txt, exit 1."""
    import multiprocessing as mp
    import time

    p = mp.get_context("fork").Process(target=_stuck_rank, args=(str(tmp_path),))
    t0 = time.time()
    p.start()
    p.join(20)
    assert p.exitcode == 1 and time.time() - t0 < 10
    report = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert "last finished step: 6" in report and "in _stuck_rank" in report
    assert (tmp_path / "error.txt").read_text().startswith(
        "paralayer: hang: rank 1 never entered the collective the others wait in (dp_cp grad_reduce, step 7")
