"""Test-only fault injection into ranks that the launcher starts (the production loop has none).

``fault_env(tmp_dir, "raise:1:3")`` returns an environment whose PYTHONPATH starts with a folder
holding a ``sitecustomize.py``; every Python process started with it (the launcher, then each
rank) registers an import hook. When a rank imports ``paralayer.runtime.train``, the hook wraps
its ``main`` so that ``train`` runs with :class:`FaultHooks` — a ``StepHooks`` that, on the
chosen rank at the chosen step, raises (``raise``), kills itself with SIGKILL (``kill``), or makes
its loss NaN (``nan``, which the global loss then carries to every rank). Run-health kinds:
``stop`` freezes the rank with SIGSTOP before that step's forward (a hung peer; it first writes its
pid to ``$TMP/stopped-pid`` so a test can clean up), ``slow`` sleeps 0.2 s (or ``slow:R:S:SECONDS``)
before every forward from that step on (a straggler), ``slowbw`` the same inside every backward, ``nan1`` / ``spike1`` poison the loss (NaN, or ×10) the first
time that step runs only (a bad batch: after a rollback the step reads other data).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = "paralayer.runtime.train"


def fault_env(tmp_dir, spec: str, base: dict | None = None) -> dict:
    """An environment that installs the fault ``KIND:RANK:STEP`` in every rank started with it."""
    folder = Path(tmp_dir) / "fault-hook"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        f"from tests.fault_hook import install_on_import\ninstall_on_import({spec!r})\n")
    env = dict(os.environ if base is None else base)
    env["PARALAYER_FAULT_DIR"] = str(folder)  # where a once-only fault (kill1) marks that it fired
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def unfreeze(tmp_dir) -> None:
    """SIGKILL the rank a ``stop`` fault froze (its pid in ``tmp_dir/stopped-pid``): a test never
    leaves a frozen rank behind, whatever happened."""
    pid_file = Path(tmp_dir, "stopped-pid")
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 9)
        except OSError:
            pass


def make_hooks(module, spec: str):
    """A ``module.StepHooks`` subclass instance for ``KIND:RANK:STEP``; several faults joined by
    commas (``kill1:1:3,stop1:1:6``) apply in turn, so that one run can hold two failures."""
    if "," in spec:
        return _joined(module, [make_hooks(module, s) for s in spec.split(",")])
    kind, rank_s, step_s, *secs = spec.split(":")
    at_rank, at_step = int(rank_s), int(step_s)
    pause = float(secs[0]) if secs else 0.2  # slow / slowbw
    done: set = set()

    backward_sleep: dict = {}

    class FaultHooks(module.StepHooks):
        def before_save(self, rank: int, step: int) -> None:
            if kind == "stopsave" and (rank, step) == (at_rank, at_step):
                _freeze(rank, step, "inside the save of")

        def before_forward(self, rank: int, step: int) -> None:
            if kind == "slow" and rank == at_rank and step >= at_step:
                time.sleep(pause)
                return
            if kind == "slowbw" and rank == at_rank and step >= at_step:
                _sleep_in_next_backward(backward_sleep, pause)
                return
            if (rank, step) != (at_rank, at_step) or kind in ("nan", "nan1", "spike1", "slow", "slowbw", "stopsave"):
                return
            if kind == "exit2":  # bad data found mid-run
                from paralayer.data.errors import DataError

                raise DataError(f"the batch of step {step} holds a token id past model.vocab_size "
                                f"(injected on rank {rank})")
            if kind in ("kill1", "stop1"):  # once in the run's life: a restarted attempt runs this step again unharmed
                mark = Path(os.environ.get("PARALAYER_FAULT_DIR", ".")) / f"fired-{rank}-{step}"
                if mark.exists():
                    return
                mark.write_text(str(time.time()))
            if kind in ("stop", "stop1"):
                import signal
                import tempfile

                Path(tempfile.gettempdir(), "stopped-pid").write_text(str(os.getpid()))
                print(f"paralayer: injecting SIGSTOP on rank {rank} at step {step} at unix time {time.time():.3f}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            when = f"at unix time {time.time():.3f}"
            if kind in ("kill", "kill1"):
                print(f"paralayer: injecting kill -9 on rank {rank} at step {step} {when}", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), 9)
            raise RuntimeError(f"injected fault on rank {rank} at step {step} {when}")

        def local_loss(self, rank: int, step: int, loss):
            if kind == "nan" and (rank, step) == (at_rank, at_step):
                return loss * float("nan")
            if kind in ("nan1", "spike1") and (rank, step) == (at_rank, at_step) and step not in done:
                done.add(step)
                return loss * (float("nan") if kind == "nan1" else 10.0)
            return loss

    return FaultHooks()


def _sleep_in_next_backward(state: dict, pause: float) -> None:
    """``slowbw``: sleep ``pause`` s at the first module backward after this call (the peer then waits in
    a backward collective: tp's, FSDP's reduce-scatter, the pipeline's gradient receive). One global
    backward pre-hook per process, armed once per step."""
    import torch

    if "handle" not in state:
        def pre(module, grad_output):
            if state.get("armed"):
                state["armed"] = False
                time.sleep(state["pause"])

        state["handle"] = torch.nn.modules.module.register_module_full_backward_pre_hook(pre)
    state["armed"] = True
    state["pause"] = pause


def _joined(module, parts: list):
    """The hooks of several faults, called in order."""
    class Joined(module.StepHooks):
        def before_save(self, rank: int, step: int) -> None:
            for p in parts:
                p.before_save(rank, step)

        def before_forward(self, rank: int, step: int) -> None:
            for p in parts:
                p.before_forward(rank, step)

        def local_loss(self, rank: int, step: int, loss):
            for p in parts:
                loss = p.local_loss(rank, step, loss)
            return loss

    return Joined()


def _freeze(rank: int, step: int, where: str) -> None:
    import signal
    import tempfile

    Path(tempfile.gettempdir(), "stopped-pid").write_text(str(os.getpid()))
    print(f"paralayer: injecting SIGSTOP on rank {rank} {where} step {step} at unix time {time.time():.3f}",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def _abort_at_exit(spec: str) -> None:
    """``abortexit:RANK:0``: once ``main`` has returned on that rank (its run finished, its done
    marker written, its teardown over), abort the process as it exits (SIGABRT: a native abort after
    the last step, issue 48). The abort is a multiprocessing exit finalizer: a rank forked by the
    local launcher's server ends through multiprocessing's exit (which skips atexit), a rank
    started as a fresh interpreter (SLURM) through atexit, and both run these finalizers."""
    for part in spec.split(","):
        kind, rank_s, _ = part.split(":")
        if kind == "abortexit" and int(os.environ.get("RANK", "-1")) == int(rank_s):
            from multiprocessing import util

            def abort(rank_s: str = rank_s) -> None:
                print(f"paralayer: injecting abort at exit on rank {rank_s} at unix time {time.time():.3f}",
                      file=sys.stderr, flush=True)
                os.abort()

            util.Finalize(None, abort, exitpriority=0)


class _InstallOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, spec: str):
        self.spec = spec

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None or found.loader is None:
            return None
        exec_module = found.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            main = module.main

            @functools.wraps(main)
            def main_with_fault(run_dir, *args, **kwargs):
                kwargs.setdefault("hooks", make_hooks(module, self.spec))
                out = main(run_dir, *args, **kwargs)
                _abort_at_exit(self.spec)
                return out

            module.main = main_with_fault

        found.loader.exec_module = exec_and_install
        return found


def install_on_import(spec: str) -> None:
    """Called from the generated sitecustomize.py: install the fault when the runtime is imported."""
    sys.meta_path.insert(0, _InstallOnImport(spec))
