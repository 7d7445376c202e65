"""Session fixtures shared by the test files.

``local_slurm``: the README's ``python -m pytest`` exercises the SLURM tests as CI does. It reuses
a running SLURM (``SLURM_CONF``, or the local cluster's default config, where ``sinfo`` answers);
otherwise, as root, it installs the packages (``cluster/install_slurm_deps.sh``, apt) and starts
the one-node cluster of ``cluster/local_slurm.sh``, and stops it after the session. It skips, with
the reason, only where it cannot: not root, no package mirror, no SLURM client tools.

``local_slurm_2node``: the same for the two-node cluster of ``cluster/local_slurm.sh start --nodes 2``
(one network namespace per node; state in /tmp/paralayer-slurm-2node, the path the profile
``local-slurm-2node`` names). It runs beside the one-node cluster; SLURM_CONF is not changed.

``PARALAYER_REQUIRE_SLURM=1`` (set by .ci/run, which installs and starts both clusters): a SLURM
that is not there FAILS these fixtures instead of skipping.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_HOME = os.environ.get("PARALAYER_SLURM_HOME", "/tmp/paralayer-slurm")
DEFAULT_CONF = os.path.join(SLURM_HOME, "etc", "slurm.conf")
_UP_STATES = ("idle", "mixed", "allocated", "completing")
REQUIRE = os.environ.get("PARALAYER_REQUIRE_SLURM") == "1"
TWO_NODE_HOME = "/tmp/paralayer-slurm-2node"  # cluster/profiles/local-slurm-2node.yaml names it
TWO_NODE_CONF = os.path.join(TWO_NODE_HOME, "etc", "slurm.conf")


def _unavailable(reason: str) -> None:
    """Skip, or fail where CI requires SLURM (PARALAYER_REQUIRE_SLURM=1)."""
    if REQUIRE:
        pytest.fail(f"PARALAYER_REQUIRE_SLURM=1 but SLURM is not available: {reason}", pytrace=False)
    pytest.skip(reason)


def slurm_answers() -> str | None:
    """None when ``sinfo`` answers with a usable node (SLURM_CONF set to the default if unset),
    else why not."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM client tools (sinfo/sbatch) not installed"
    env = dict(os.environ)
    if not env.get("SLURM_CONF"):
        if not os.path.isfile(DEFAULT_CONF):
            return f"SLURM_CONF unset and {DEFAULT_CONF} missing"
        env["SLURM_CONF"] = DEFAULT_CONF
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10, env=env)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"sinfo failed: {exc}"
    if r.returncode != 0 or not any(s.rstrip("*~#") in _UP_STATES for s in r.stdout.split()):
        return f"SLURM not up (sinfo rc={r.returncode}: {(r.stdout + r.stderr).strip()[:200]})"
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    return None


def _start_local_slurm() -> tuple[bool, str]:
    """Install (apt, as root) and start cluster/local_slurm.sh: (started, reason if not)."""
    if os.geteuid() != 0:
        return False, "not root: cannot install or start the local SLURM (run cluster/local_slurm.sh start as root)"
    env = dict(os.environ, PARALAYER_SLURM_HOME=SLURM_HOME)
    env.pop("SLURM_CONF", None)
    try:
        inst = subprocess.run(["bash", str(REPO / "cluster" / "install_slurm_deps.sh")], capture_output=True,
                              text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return False, "installing the SLURM packages took more than 15 min (no package mirror?)"
    if inst.returncode != 0:
        return False, f"could not install the SLURM packages: {(inst.stdout + inst.stderr).strip()[-300:]}"
    start = subprocess.run(["bash", str(REPO / "cluster" / "local_slurm.sh"), "start"], capture_output=True,
                           text=True, timeout=300, env=env)
    if start.returncode != 0:
        # packages present but the cluster does not come up: a bug in our script, not a reason to skip
        raise RuntimeError(f"cluster/local_slurm.sh start failed:\n{start.stderr[-2000:]}")
    for line in start.stdout.splitlines():
        if line.startswith("export SLURM_CONF="):
            os.environ["SLURM_CONF"] = line.split("=", 1)[1].strip()
    return True, ""


@pytest.fixture(scope="session")
def local_slurm():
    """A usable SLURM for the session: reused if running, else installed and started (and
    stopped at the end). Yields SLURM_CONF."""
    reason = slurm_answers()
    started = False
    if reason:
        started, why = _start_local_slurm()
        if not started:
            _unavailable(f"{reason}; {why}")
        reason = slurm_answers()
        if reason:
            raise RuntimeError(f"the local SLURM started but does not answer: {reason}")
    try:
        yield os.environ["SLURM_CONF"]
    finally:
        if started:
            subprocess.run(["bash", str(REPO / "cluster" / "local_slurm.sh"), "stop"], capture_output=True,
                           timeout=120, env=dict(os.environ, PARALAYER_SLURM_HOME=SLURM_HOME))


def two_nodes_answer() -> str | None:
    """None when the two-node cluster answers with n1 and n2 usable, else why not."""
    if shutil.which("sinfo") is None or not os.path.isfile(TWO_NODE_CONF):
        return f"no two-node SLURM ({TWO_NODE_CONF} missing or no sinfo)"
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10,
                           env=dict(os.environ, SLURM_CONF=TWO_NODE_CONF))
    except (subprocess.SubprocessError, OSError) as exc:
        return f"sinfo failed: {exc}"
    up = {ln.split()[0] for ln in r.stdout.splitlines() if len(ln.split()) == 2
          and ln.split()[1].rstrip("*~#") in _UP_STATES and not ln.split()[1].endswith("*")}
    if r.returncode != 0 or not {"n1", "n2"} <= up:
        return f"two-node SLURM not up (sinfo rc={r.returncode}: {(r.stdout + r.stderr).strip()[:200]})"
    return None


@pytest.fixture(scope="session")
def local_slurm_2node():
    """The two-node SLURM: reused if up, else started (``local_slurm.sh start --nodes 2``, packages
    installed where needed) and stopped at the end. Yields its slurm.conf."""
    script = str(REPO / "cluster" / "local_slurm.sh")
    env = dict(os.environ, PARALAYER_SLURM_HOME=TWO_NODE_HOME)
    env.pop("SLURM_CONF", None)
    started = False
    if two_nodes_answer():
        if os.geteuid() != 0:
            _unavailable("not root: cannot start the two-node SLURM (cluster/local_slurm.sh start --nodes 2)")
        if shutil.which("slurmd") is None:
            inst = subprocess.run(["bash", str(REPO / "cluster" / "install_slurm_deps.sh")], capture_output=True,
                                  text=True, timeout=900, env=env)
            if inst.returncode != 0:
                _unavailable(f"could not install the SLURM packages: {(inst.stdout + inst.stderr).strip()[-300:]}")
        start = subprocess.run(["bash", script, "start", "--nodes", "2"], capture_output=True, text=True,
                               timeout=300, env=env)
        if start.returncode != 0:
            raise RuntimeError(f"cluster/local_slurm.sh start --nodes 2 failed:\n{start.stderr[-2000:]}")
        started = True
        why = two_nodes_answer()
        if why:
            raise RuntimeError(f"the two-node SLURM started but does not answer: {why}")
    try:
        yield TWO_NODE_CONF
    finally:
        if started:
            subprocess.run(["bash", script, "stop", "--nodes", "2"], capture_output=True, timeout=120, env=env)



def pytest_configure(config):
    """An xdist worker computes on one thread: two workers share the 2 cores, and torch's default of
    one thread per core made each in-process model spin two OpenMP threads against the other
    worker (test_qwen3_next's one-rank comparison: 13 s of wall under load, 5 s on one thread).
    Forked ranks inherit it; launched ranks set ``train.threads`` themselves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


#: Test files that submit to the real SLURM clusters: one xdist worker runs all of them, one after
#: another, so two files never compete for the clusters' task slots (their deadlines assume that).
SLURM_FILES = {"test_slurm.py", "test_slurm_e2e.py", "test_multinode.py", "test_recovery_slurm.py"}


#: the groups that take longest (seconds of a worker in a full run, 7 Dec): handed out first
LONGEST = ("slurm", "test_combinations.py", "test_runtime.py", "test_recovery.py", "test_planner.py",
           "test_straggler_stopped.py", "test_planner_pruning.py", "test_split_backward.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``-n N --dist loadgroup`` (pyproject's addopts) each file's tests stay on one worker,
    so a module's shared one-rank references are computed once; the SLURM files share one group.
    tryfirst: xdist's own hook turns the marks into the "@group" the scheduler reads, so the marks
    must be there before it runs (without it no test had a group, and two SLURM files ran at once:
    a test that kills node n2 failed another file's job on the two-node cluster)."""
    groups = {}
    for item in items:
        name = item.path.name
        groups[item] = "slurm" if name in SLURM_FILES else name
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # the scheduler hands out groups in this order (pyproject: --no-loadscope-reorder): the longest
    # first, so that neither worker starts one of them near the end while the other sits idle
    count: dict = {}
    for g in groups.values():
        count[g] = count.get(g, 0) + 1
    first = {g: i for i, g in enumerate(LONGEST)}
    items.sort(key=lambda it: (first.get(groups[it], len(first)), -count[groups[it]], groups[it]))


@pytest.fixture(scope="module")
def env2(local_slurm_2node):
    """The environment of a launch onto the two-node SLURM: its slurm.conf, this checkout first on
    PYTHONPATH, no torch.distributed variables of ours."""
    import submitit  # noqa: F401 - a dependency: missing is a failure, not a skip

    env = dict(os.environ, SLURM_CONF=local_slurm_2node)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(k, None)
    return env
