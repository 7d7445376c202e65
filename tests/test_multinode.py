"""Multi-node for real (issue 29): the two-node SLURM of ``cluster/local_slurm.sh start --nodes 2``
(one network namespace per node: hostnames n1, n2, their own addresses and slurmd), driven through
``python launch.py ... cluster=local-slurm-2node`` as a user would.

To keep CI inside its budget on 2 cores the cases share jobs:
- one batch of launches run side by side: a 2-element sweep of 2-node runs (a job array; the
  parity run against the same layout on one node, placement.json against the plan's spans, the
  sweep report), forced cyclic distributions (the placement refusals: tp, with the pre-flight
  rehearsal of the first and last pipeline rank, and tiny-moe's ep), ``cluster.network_interface=lo``
  (the loopback trap), the one-node reference and the --dry-run spans;
- one long job: preempted (SIGTERM then USR2) on both nodes, requeued, then node n2 loses power
  (every process in its namespace SIGKILLed): the survivors exit, the launcher names the node and
  the ranks, SLURM requeues the job and it resumes elastically on n1 alone (dp=auto, 4 -> 2 ranks).
Every wait has a deadline. Requires root (the fixture starts the cluster when it is not up).
"""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paralayer.dispatch.rendezvous import rendezvous_trap

REPO = Path(__file__).resolve().parents[1]
LAUNCH = str(REPO / "launch.py")
SCRIPT = str(REPO / "cluster" / "local_slurm.sh")
SMALL = ["recipe=tiny", "model.d_model=64", "model.seq_len=32", "model.ffn_hidden=128",
         "logging.wandb.mode=disabled", "logging.progress=true"]
TWO = [*SMALL, "cluster=local-slurm-2node"]


# ----------------------------------------------------------------------------- no cluster needed
def test_rendezvous_traps_name_the_variable_and_the_fix():
    lo = {"vm": ["127.0.0.1"], "n1": ["10.0.0.3"], "h127": ["127.0.1.1", "10.0.0.9"]}
    res = lo.__getitem__
    why = rendezvous_trap(2, {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "n1"}, "n1", res)
    assert why.startswith("GLOO_SOCKET_IFNAME=lo on a job of 2 nodes") and "cluster.network_interface" in why
    why = rendezvous_trap(2, {"MASTER_ADDR": "vm", "GLOO_SOCKET_IFNAME": "eth0"}, "n1", res)
    assert why.startswith("MASTER_ADDR=vm resolves to the loopback address 127.0.0.1") and "network_interface" in why
    why = rendezvous_trap(2, {"MASTER_ADDR": "n1"}, "h127", res)
    assert why.startswith("GLOO_SOCKET_IFNAME is unset and this node's hostname h127 resolves to 127.0.1.1")
    assert rendezvous_trap(2, {"MASTER_ADDR": "n1", "GLOO_SOCKET_IFNAME": "eth0"}, "n1", res) is None
    assert rendezvous_trap(2, {"MASTER_ADDR": "n1"}, "n1", res) is None
    assert rendezvous_trap(1, {"MASTER_ADDR": "vm", "GLOO_SOCKET_IFNAME": "lo"}, "vm", res) is None  # one node


def test_network_interface_and_min_nodes_reach_every_task():
    from paralayer.dispatch.slurm import DispatchError, executor_parameters

    p = executor_parameters({"nodes": 2, "devices_per_node": 2, "device": "cpu", "network_interface": "eth0",
                             "slurm": {"min_nodes": 1}})
    assert "export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in p["slurm_setup"]
    assert p["slurm_additional_parameters"]["nodes"] == "1-2" and p["nodes"] == 2
    with pytest.raises(DispatchError, match="cluster.slurm.min_nodes=3"):
        executor_parameters({"nodes": 2, "device": "cpu", "slurm": {"min_nodes": 3}})


def test_placement_refusal_names_axis_hosts_and_fix():
    from paralayer.runtime.placement import refusal

    plan = {"spans": {"tp": "intra-node", "dp": "inter-node", "pp": "intra-node", "cp": "intra-node"},
            "degrees": {"tp": 2, "dp": 2, "pp": 1, "cp": 1}}
    bad = {"tp": {"spans": "inter-node", "hosts": ["n1", "n2"], "ranks": [0, 1]},
           "dp": {"spans": "inter-node", "hosts": ["n1", "n2"], "ranks": [0, 2]}}
    why = refusal(plan, bad)
    assert why.startswith("placement: tp (degree 2) is planned inside a node but its ranks [0, 1] run on hosts n1, n2")
    assert "--distribution=cyclic" in why and "cluster.devices_per_node" in why
    good = {"tp": {"spans": "intra-node", "hosts": []}, "dp": bad["dp"]}
    assert refusal(plan, good) is None  # dp is planned across nodes


def test_placement_checks_ep_and_every_axis_the_plan_places():
    """ep (the expert grid) is checked and refused by name, as tp is; so is any axis plan.json
    places inside a node. A planted copy of the old check (tp, cp, pp, dp only) lets it through."""
    from paralayer.runtime.placement import refusal

    plan = {"spans": {"tp": "intra-node", "pp": "intra-node", "cp": "intra-node", "ep": "intra-node",
                      "dp": "inter-node"}, "degrees": {"tp": 1, "pp": 1, "cp": 1, "ep": 2, "dp": 4}}
    cyclic = {"ep": {"spans": "inter-node", "hosts": ["n1", "n2"], "ranks": [0, 1]},
              "dp": {"spans": "inter-node", "hosts": ["n1", "n2"], "ranks": [0, 1, 2, 3]}}
    why = refusal(plan, cyclic)
    assert why and why.startswith("placement: ep (degree 2) is planned inside a node but its ranks [0, 1] run on "
                                  "hosts n1, n2"), why
    assert refusal(plan, dict(cyclic, ep={"spans": "intra-node", "hosts": []})) is None

    def old_refusal(plan, real):  # the planted copy: the axes the check looked at before
        return next((a for a in ("tp", "cp", "pp", "dp") if plan["degrees"].get(a, 1) > 1
                     and plan["spans"].get(a) == "intra-node" and real.get(a, {}).get("spans") == "inter-node"), None)
    assert old_refusal(plan, cyclic) is None
    plan2 = {"spans": dict(plan["spans"], edp="intra-node"), "degrees": dict(plan["degrees"], edp=2)}
    edp = {"edp": {"spans": "inter-node", "hosts": ["n1", "n2"], "ranks": [0, 2]}}
    assert refusal(plan2, edp).startswith("placement: edp (degree 2)")  # any axis the plan places


def test_real_spans_see_the_expert_grid():
    """The ep groups of the mesh (consecutive data ranks) against hosts: cyclic spans them."""
    from types import SimpleNamespace

    import torch

    from paralayer.runtime.placement import real_spans

    grid = lambda t, names: SimpleNamespace(mesh=t, mesh_dim_names=names)  # noqa: E731 - a DeviceMesh's view
    world = grid(torch.arange(4).view(1, 4, 1, 1), ("pp", "dp", "cp", "tp"))
    expert = grid(torch.arange(4).view(1, 2, 2, 1), ("pp", "edp", "ep", "tp"))
    meshes = SimpleNamespace(world=world, expert=expert)
    block = {r: {"host": f"n{r // 2 + 1}"} for r in range(4)}
    cyclic = {r: {"host": f"n{r % 2 + 1}"} for r in range(4)}
    assert real_spans(meshes, block)["ep"]["spans"] == "intra-node"
    got = real_spans(meshes, cyclic)["ep"]
    assert got["spans"] == "inter-node" and got["ranks"] == [0, 1] and got["hosts"] == ["n1", "n2"]


# ----------------------------------------------------------------------------- helpers
def _popen(args, log: Path, env, cwd):
    return subprocess.Popen([sys.executable, LAUNCH, *args], cwd=cwd, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)


def _records(run_dir) -> list[dict]:
    p = Path(run_dir, "metrics.jsonl")
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip() and "loss" in x]


def _spans_of(placement: dict, tp: int, dp: int) -> dict:
    """Spans of the tp and dp groups from placement.json (world = dp x tp, tp fastest)."""
    host = {int(r): w["host"] for r, w in placement.items()}
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    where = lambda gs: "inter-node" if any(len({host[r] for r in g}) > 1 for g in gs) else "intra-node"  # noqa: E731
    return {"tp": where(tp_groups), "dp": where(dp_groups)}


def _sacct(job: str, env, fields="JobID,State,NodeList", dup=False) -> list[list[str]]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", fields, "-j", job] + (["-D"] if dup else []),
                         capture_output=True, text=True, timeout=30, env=env).stdout
    return [x.split("|") for x in out.splitlines() if x.strip()]


def _wait(cond, what: str, proc, log: Path, deadline_s: float):
    end = time.monotonic() + deadline_s
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"launcher exited (rc {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {deadline_s:.0f}s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


# ----------------------------------------------------------------------------- against the two-node SLURM
@pytest.mark.timeout(1200)  # a ceiling for a loaded machine; ~2-5 min on an idle 2-core one
def test_two_node_sweep_parity_placement_and_refusals(env2, tmp_path):
    """One batch, side by side: the sweep (2 elements x 2 nodes x 2 ranks), the cyclic refusals (tp,
    and ep: tiny-moe with ep 2 over dp 4, which the check before issue #37 let train), the loopback
    trap, the one-node reference, the dry run. The ep job waits for free task slots (the others
    take all 8 of each node) and shares the batch's wall instead of costing its own launch."""
    t0 = time.monotonic()
    sweep, cyc, ep, lo, ref = (tmp_path / n for n in ("sweep", "cyclic", "ep", "lo", "ref"))
    moe = [a.replace("recipe=tiny", "recipe=tiny-moe") for a in TWO]
    procs = {
        "sweep": _popen([*TWO, "-m", "train.lr=3e-3,1e-3", "train.steps=3", f"run.dir={sweep}", "--no-rehearse",
                         "--wait"], tmp_path / "sweep.log", env2, tmp_path),
        "cyclic": _popen([*TWO, "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "train.steps=2",
                          "cluster.slurm.srun_args=[--distribution=cyclic]", f"run.dir={cyc}", "--wait"],
                         tmp_path / "cyclic.log", env2, tmp_path),
        "ep": _popen([*moe, "parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "parallel.ep=2", "train.steps=2",
                      "cluster.slurm.srun_args=[--distribution=cyclic]", f"run.dir={ep}", "--no-rehearse", "--wait"],
                     tmp_path / "ep.log", env2, tmp_path),
        "lo": _popen([*TWO, "cluster.network_interface=lo", "train.steps=2", f"run.dir={lo}", "--no-rehearse",
                      "--wait"], tmp_path / "lo.log", env2, tmp_path),
        "ref": _popen([*SMALL, "cluster=local", "train.lr=3e-3", "train.steps=3", f"run.dir={ref}"],
                      tmp_path / "ref.log", env2, tmp_path),
    }
    dry = subprocess.run([sys.executable, LAUNCH, *TWO, "--dry-run", "--json"], capture_output=True, text=True,
                         timeout=120, env=env2, cwd=tmp_path)
    rcs, logs = {}, {}
    try:
        for name, p in procs.items():
            rcs[name] = p.wait(timeout=800)
            logs[name] = (tmp_path / f"{name}.log").read_text()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    took = time.monotonic() - t0

    # the sweep: one job array, both elements on both nodes, both completed, the report reads both
    assert rcs["sweep"] == 0, logs["sweep"][-4000:]
    array = re.search(r"submitted job array (\d+) \(2 run\(s\)\)", logs["sweep"])
    assert array, logs["sweep"][-2000:]
    rows = _sacct(array.group(1), env2)
    assert sorted((j, s, n) for j, s, n in rows) == [(f"{array.group(1)}_0", "COMPLETED", "n[1-2]"),
                                                     (f"{array.group(1)}_1", "COMPLETED", "n[1-2]")], rows
    elems = sorted(p for p in sweep.iterdir() if (p / "plan.json").is_file())
    assert len(elems) == 2, list(sweep.iterdir())
    rep = subprocess.run([sys.executable, "-m", "paralayer.report", str(sweep)], capture_output=True, text=True,
                         timeout=120, env=env2, cwd=tmp_path)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    with open(sweep / "report.csv") as f:
        assert len(list(csv.DictReader(f))) == 2

    # parity: the lr=3e-3 element on 2 nodes against the same layout on one node (cluster=local)
    assert rcs["ref"] == 0, logs["ref"][-3000:]
    plan = json.loads(dry.stdout)
    assert plan["degrees"]["tp"] == 2 and plan["degrees"]["dp"] == 2 and plan["world_size"] == 4, dry.stdout[-500:]
    mine = next(e for e in elems if json.loads((e / "plan.json").read_text())["world_size"] == 4
                and "0.003" in (e / "resolved.yaml").read_text())
    two, one = _records(mine), _records(ref)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(two, one):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)
    bitwise = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(two, one))

    # placement: ranks 0,1 on one node and 2,3 on the other; the real spans are the dry run's
    for e in elems:
        where = json.loads((e / "placement.json").read_text())
        assert sorted(where) == ["0", "1", "2", "3"]
        assert {where["0"]["host"], where["2"]["host"]} == {"n1", "n2"}, where
        assert [where[r]["local_rank"] for r in "0123"] == [0, 1, 0, 1], where
        assert _spans_of(where, 2, 2) == {"tp": plan["spans"]["tp"], "dp": plan["spans"]["dp"]} \
            == {"tp": "intra-node", "dp": "inter-node"}

    # the refusal: tp across nodes under --distribution=cyclic stops before step 1, in one line;
    # the pre-flight rehearsal ran the first and last pipeline rank of the 2-node world first
    assert rcs["cyclic"] != 0, logs["cyclic"][-3000:]
    assert "pre-flight rehearsal of ranks [0, 2] passed" in logs["cyclic"], logs["cyclic"][-3000:]
    assert re.search(r"error: placement: tp \(degree 2\) is planned inside a node but its ranks \[0, 1\] run on "
                     r"hosts n1, n2; .*--distribution=cyclic", logs["cyclic"]), logs["cyclic"][-3000:]
    assert not _records(cyc) and json.loads((cyc / "placement.json").read_text())["1"]["host"] == "n2"
    # ep across nodes: the plan keeps each expert group on one node, cyclic puts ranks 0 and 1 on
    # n1 and n2, and the job stops before step 1 naming ep
    assert rcs["ep"] != 0, logs["ep"][-3000:]
    assert re.search(r"error: placement: ep \(degree 2\) is planned inside a node but its ranks \[0, 1\] run on "
                     r"hosts n1, n2; .*--distribution=cyclic", logs["ep"]), logs["ep"][-3000:]
    assert not _records(ep) and json.loads((ep / "placement.json").read_text())["1"]["host"] == "n2"

    # the loopback trap: named, with the fix, before any collective
    assert rcs["lo"] != 0, logs["lo"][-3000:]
    assert re.search(r"error: rank \d on n[12]: GLOO_SOCKET_IFNAME=lo on a job of 2 nodes: "
                     r".*cluster\.network_interface", logs["lo"]), logs["lo"][-3000:]
    assert not _records(lo) and not (lo / "placement.json").exists()
    print(f"batch of 6 launches: {took:.0f}s; parity {'bitwise' if bitwise else '<= 1e-6'}")


def _python_pids(ns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
    pids = set()
    for p in out:
        try:
            if Path(f"/proc/{p}/comm").read_text().startswith("python"):
                pids.add(int(p))
        except OSError:
            pass
    return pids


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists()}


@pytest.mark.timeout(1200)  # a ceiling for a loaded machine; ~2-5 min on an idle 2-core one
def test_preempted_then_node_lost_requeues_and_resumes_elastically(env2, tmp_path):
    steps, every = 8, 2
    run, log = tmp_path / "run", tmp_path / "launch.log"
    t0 = time.monotonic()
    proc = _popen([*TWO, "parallel.dp=auto", f"train.steps={steps}", f"checkpoint.every={every}",
                   "cluster.slurm.min_nodes=1", f"run.dir={run}", "--no-rehearse", "--wait"], log, env2, tmp_path)
    job = None
    resumed = re.compile(r"resumed from \S+step-(\d+) at step (\d+)")
    try:
        _wait(lambda: len(_records(run)) >= 3, "step 3", proc, log, 400)
        job = re.search(r"submitted job (\d+) ", log.read_text()).group(1)
        # preemption: SIGTERM then USR2 to every task on both nodes
        for sig in ("TERM", "USR2"):
            r = subprocess.run(["scancel", f"--signal={sig}", job], capture_output=True, text=True, timeout=30,
                               env=env2)
            assert r.returncode == 0, r.stderr
        _wait(lambda: resumed.search(log.read_text()), "the resume after preemption", proc, log, 400)
        first = resumed.search(log.read_text())
        k = int(first.group(1))
        ck = run / "checkpoints" / f"step-{k:08d}"
        assert sorted(p.name for p in ck.glob("__*_0.distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # all ranks
        _wait(lambda: len(_records(run)) >= k + 1 and len(_python_pids("pls-n1")) >= 2, "training after the resume",
              proc, log, 300)
        # power loss of n2: every process in its namespace, at once
        survivors = _python_pids("pls-n1")
        last = max(r["step"] for r in _records(run))
        tk = time.monotonic()
        subprocess.run(["bash", SCRIPT, "kill-node", "2", "--nodes", "2"], check=True, timeout=30,
                       env=dict(env2, PARALAYER_SLURM_HOME="/tmp/paralayer-slurm-2node"))
        while _alive(survivors) and time.monotonic() - tk < 60:
            time.sleep(0.5)
        exit_s = time.monotonic() - tk
        assert not _alive(survivors), f"ranks on n1 still running 60 s after n2 died: {_alive(survivors)}"
        rc = proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
            if job:
                subprocess.run(["scancel", job], timeout=30, env=env2)
        subprocess.run(["bash", SCRIPT, "start", "--nodes", "2"], capture_output=True, timeout=120,
                       env=dict(env2, PARALAYER_SLURM_HOME="/tmp/paralayer-slurm-2node"))
    text = log.read_text()
    assert rc == 0, text[-5000:]
    assert re.search(r"SIGUSR2 after step (\d+): checkpoint saved", text), text[-3000:]
    assert re.search(rf"job {job}: node n2 lost \(NODE_FAIL\): rank\(s\) 2, 3 of ", text), text[-5000:]
    assert "elastic resume on 1 node(s): re-planned for 2 rank(s)" in text, text[-5000:]
    res = [(int(a), int(b)) for a, b in resumed.findall(text)]
    assert len(res) == 2 and all(b == a + 1 for a, b in res), res
    assert res[1][0] >= last - every, (res, last)  # nothing lost beyond checkpoint.every
    assert [r["step"] for r in _records(run)] == list(range(1, steps + 1))  # each step once
    assert json.loads((run / "plan.json").read_text())["world_size"] == 2
    states = [s for _, s, _ in _sacct(job, env2, dup=True)]
    assert states == ["REQUEUED", "NODE_FAIL", "COMPLETED"], states
    assert _sacct(job, env2)[0][2] == "n1"
    show = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30,
                          env=env2).stdout
    assert "Comment=lost node n2 ranks 2,3" in show, show
    print(f"preempt at step {k}, n2 lost after step {last}: survivors out in {exit_s:.1f}s, resumed at "
          f"{res[1][1]} on n1; {time.monotonic() - t0:.0f}s")
