"""The front door's subcommands: every user-facing action that is not a training launch, under one
name (``paralayer CMD ...`` = ``python launch.py CMD ...`` = ``python -m paralayer CMD ...``).

Why: the actions grew as separate module paths (``python -m paralayer.report``, ``...checkpoint.
export``, ``...data.prepare``, ``cluster/local_slurm.sh``), which a wheel install cannot even
reach by path. Each subcommand here hands its arguments to the module that owns the action, by
module name (imported when it runs: ``paralayer --dry-run`` never pays for torch), so the owning
module keeps its own flags and help. The README's command table lists them all, and
tests/test_commands.py runs every row.

    paralayer [train] [recipe=NAME] [key=value ...] [--dry-run|--plan|--rehearse|-m ...]  (paralayer.cli)
    paralayer report DIR... [--out DIR]           the sweep report (paralayer.metrics.report)
    paralayer export RUN_DIR --out DIR            a run's checkpoint as a Hugging Face model
    paralayer prepare INPUT... --out PREFIX       text/jsonl/parquet -> indexed shards (paralayer.data.prepare)
    paralayer slurm start|stop|status|env [--nodes N]   the shipped one-machine SLURM (cluster/local_slurm.sh)
    paralayer slurm install-deps                  its Debian packages (cluster/install_slurm_deps.sh)
    paralayer resubmit RUN_DIR... --profile NAME  a run directory submitted to SLURM again
"""
from __future__ import annotations

import importlib
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

#: the verb that is the default action: ``paralayer train recipe=tiny`` = ``paralayer recipe=tiny``
TRAIN = "train"
EXIT_INVALID = 2
EXIT_FAILED = 1


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_INVALID


def _delegate(module: str, prog: str, fix: Optional[Callable[[list], list]] = None) -> Callable[[list], int]:
    """A subcommand that runs ``module.main(argv)`` under the name ``paralayer PROG``."""

    def run(argv: list) -> int:
        if importlib.util.find_spec(module) is None:
            return _err(f"{prog}: {module} is not part of this paralayer install")
        from paralayer.inputs.untrusted import guard

        return guard(prog, lambda: importlib.import_module(module).main(fix(argv) if fix else argv))

    return run


def _export(argv: list) -> int:
    """export: a missing or broken run directory is one line, exit 2 (not a traceback)."""
    return _delegate("paralayer.checkpoint.export", "export")(argv)


def _profile_paths(argv: list) -> list:
    """resubmit: ``--profile NAME`` may name a profile (looked up as ``cluster=NAME`` is)."""
    from paralayer.config import recipes

    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--profile" and not Path(out[i + 1]).is_file():
            found = recipes.find("profiles", out[i + 1])
            out[i + 1] = str(found) if found else out[i + 1]
    return out


SLURM_HELP = """usage: paralayer slurm [--dry-run] start [--nodes N] | stop | restart | status | env | install-deps

A real SLURM on this machine (munge, mariadb, slurmdbd, slurmctld, slurmd), as root, without
systemd: the shipped cluster/local_slurm.sh (here: {script}). `install-deps` runs
cluster/install_slurm_deps.sh (the Debian packages it needs). --dry-run prints the command only.
Settings are the script's environment variables (PARALAYER_SLURM_HOME, ...; see its header)."""


def slurm_command(argv: Sequence[str]) -> list[str]:
    """The command ``paralayer slurm ARGS`` runs (the shipped scripts, through bash)."""
    from paralayer.config import recipes

    if list(argv[:1]) == ["install-deps"]:
        return ["bash", str(recipes.shipped_script("install_slurm_deps.sh")), *argv[1:]]
    return ["bash", str(recipes.shipped_script("local_slurm.sh")), *argv]


#: most nodes the shipped SLURM starts on one machine (cluster/local_slurm_nodes.sh: a /28 subnet)
MAX_LOCAL_NODES = 12


def slurm_args_problem(argv: Sequence[str]) -> Optional[str]:
    """The one-line problem with ``paralayer slurm ACTION ARGS``, checked before bash sees them
    (a bare ``--nodes`` looped forever in the script; a huge one was bash's overflow error)."""
    from paralayer.inputs.echo import one_line

    action, rest = argv[0], list(argv[1:])
    if action == "install-deps":
        return f"slurm install-deps: takes no arguments, got '{one_line(rest[0], 40)}'" if rest else None
    while rest:
        a = rest.pop(0)
        if a == "--nodes" or a.startswith("--nodes="):
            value = a.partition("=")[2] if "=" in a else (rest.pop(0) if rest else None)
            if value is None or not value.isdigit() or not 1 <= int(value[:4]) <= MAX_LOCAL_NODES or len(value) > 3:
                shown = "nothing" if value is None else f"'{one_line(value, 40)}'"
                return f"--nodes: expected a whole number from 1 to {MAX_LOCAL_NODES}, got {shown}"
            if action not in ("start", "restart", "stop", "status", "env"):
                return f"--nodes: not an option of slurm {action}"
        else:
            return f"slurm {action}: unknown argument '{one_line(a, 40)}'; valid: --nodes N"
    return None


def _slurm(argv: list) -> int:
    from paralayer.config import recipes
    from paralayer.inputs.echo import one_line

    dry = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(SLURM_HELP.format(script=recipes.shipped_script("local_slurm.sh")))
        return 0
    if argv[0] not in ("start", "stop", "restart", "status", "env", "install-deps"):
        return _err(f"slurm: unknown action '{one_line(argv[0], 40)}'; valid: start, stop, restart, status, env, "
                    "install-deps")
    problem = slurm_args_problem(argv)
    if problem:
        return _err(problem)
    cmd = slurm_command(argv)
    if dry:
        print(shlex.join(cmd))
        return 0
    if not Path(cmd[1]).is_file():
        return _err(f"slurm: {cmd[1]} is missing from this install")
    return subprocess.run(cmd).returncode


#: subcommand -> (what it does, for --help and the README table; how it runs)
COMMANDS: dict[str, tuple[str, Callable[[list], int]]] = {
    "report": ("the sweep report of run folders (report.csv, .md, .png)",
               _delegate("paralayer.metrics.report", "report")),
    "export": ("a run's checkpoint as a Hugging Face model folder", _export),
    "prepare": ("text/jsonl/parquet files into indexed shards (PREFIX.bin/.idx)",
                _delegate("paralayer.data.prepare", "prepare")),
    "slurm": ("start/stop the shipped one-machine SLURM (cluster/local_slurm.sh)", _slurm),
    "resubmit": ("run directories submitted to SLURM again (--profile NAME or FILE)",
                 _delegate("paralayer.dispatch.slurm", "resubmit", _profile_paths)),
}


def run_old_spelling(module: str, argv: Optional[Sequence[str]] = None) -> int:
    """``python -m paralayer.report`` / ``paralayer.export`` (paralayer/__init__.py OLD_SPELLINGS):
    the command they spell; export also names its new spelling once on stderr."""
    from paralayer import OLD_SPELLINGS

    verb = OLD_SPELLINGS[module]
    if verb == "export":
        print("note: `python -m paralayer.export` is now `paralayer export` (or `python -m paralayer export`)",
              file=sys.stderr)
    return run([verb, *(sys.argv[1:] if argv is None else argv)])


def is_command(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0] in COMMANDS


def strip_train(argv: Sequence[str]) -> list[str]:
    """``train ARGS`` is ``ARGS`` (the launch is the default action)."""
    return list(argv[1:]) if list(argv[:1]) == [TRAIN] else list(argv)


def run(argv: Sequence[str]) -> int:
    """Run subcommand ``argv[0]`` with the rest of ``argv``; its exit code."""
    return COMMANDS[argv[0]][1](list(argv[1:]))


def help_text() -> str:
    """The subcommands, one line each (``paralayer --help``)."""
    rows = [f"  {TRAIN:<9} the default: paralayer [train] recipe=NAME [key=value ...] [flags]"]
    rows += [f"  {name:<9} {what}" for name, (what, _) in COMMANDS.items()]
    return "commands (paralayer CMD --help for each):\n" + "\n".join(rows)
