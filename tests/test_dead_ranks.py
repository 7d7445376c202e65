"""Which ranks died on their own (paralayer/dispatch/slurm_restart.py), from the tasks' results and
srun's own lines: torch-free, no SLURM. The lines below are srun's, from a CI run in which rank 2
was SIGKILLed (fault_hook kill1) and srun's teardown killed rank 1 before it wrote a result."""
from __future__ import annotations

from paralayer.dispatch.slurm_restart import dead_ranks, torn_down

PEER = ("error", "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.47.4]:33971")
SRUN = ["srun: error: n1: task 0: Exited with exit code 1\n", "srun: error: n1: task 1: Killed\n",
        "srun: error: n2: task 3: Killed\n", "srun: Force Terminated StepId=109.0\n"]


def test_a_rank_torn_down_after_a_peers_error_is_not_blamed():
    outcomes = [PEER, None, None, PEER]  # ranks 0 and 3 saw their peer vanish; 1 and 2 left nothing
    assert torn_down(SRUN) == {1, 3}
    assert dead_ranks(outcomes, torn_down(SRUN)) == [2]
    assert dead_ranks(outcomes) == [1, 2]  # without srun's lines: the old answer, both named


def test_the_first_task_srun_reports_killed_is_not_torn_down():
    lines = ["srun: error: n2: task 2: Killed\n", "srun: error: n1: task 0: Exited with exit code 1\n",
             "srun: error: n1: task 1: Killed\n"]
    assert torn_down(lines) == {1}
    assert dead_ranks([PEER, None, None, PEER], torn_down(lines)) == [2]


def test_tasks_srun_killed_after_terminating_the_step_are_torn_down():
    """srun's lines from a CI run here in which rank 2 was SIGKILLed first: srun then ended the step
    ("Terminating StepId") and killed the other tasks, ranks 0 and 1 in one line ("tasks 0-1")."""
    lines = ["srun: error: n2: task 2: Killed\n", "srun: launch/slurm: _step_signal: Terminating StepId=149.0\n",
             "srun: error: n1: tasks 0-1: Killed\n", "srun: error: n2: task 3: Killed\n",
             "srun: Force Terminated StepId=149.0\n"]
    assert torn_down(lines) == {0, 1, 3}
    assert dead_ranks([PEER, None, None, PEER], torn_down(lines)) == [2]
    assert torn_down(["srun: error: n1: tasks 0,2-3: Exited with exit code 1\n",
                      "srun: error: n1: tasks 1,4: Killed\n"]) == {1, 4}


def test_when_every_silent_rank_was_torn_down_they_are_all_named():
    """Nothing left to blame but the torn-down tasks: they are named (the old rule), never nobody."""
    assert dead_ranks([PEER, None, PEER, PEER], {1}) == [1]
    assert dead_ranks([PEER, PEER], set()) == [0, 1]  # every failed task only saw its peers vanish
    own = ("error", "ValueError: a bad batch")
    assert dead_ranks([own, None, PEER], {1}) == [0]
    assert torn_down(["paralayer: rank 1 failed\n", "srun: error: n1: task 1: Killed\n"]) == set()
