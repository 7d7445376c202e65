"""A sweep's folder: runs named by what differs, the index kept in metadata, and the report at
the end.

Why names: ``000/``, ``001/`` say nothing; ``tp2-pp2-zero1/`` says which layout it holds. Each
run folder gets a ``sweep.json`` (its index, name, the overrides that set it apart, the sweep's
W&B group; on SLURM its job id, state and log files); the sweep folder gets one listing the runs
in order, which is what ``python -m paralayer.report`` reads.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

from paralayer import config as config_mod

SWEEP_FILE = "sweep.json"
#: names longer than this are cut (and made unique by their index)
MAX_NAME = 80


def _name_part(key: str, value: str, short: str) -> str:
    """``parallel.tp=2`` -> ``tp2``; ``parallel.schedule=gpipe`` -> ``schedule_gpipe``."""
    v = value.strip("[]").replace(",", "x") if value.startswith("[") else value
    sep = "" if re.fullmatch(r"-?[0-9][0-9.e+-]*", v) else "_"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", f"{short}{sep}{v}")


def run_names(overrides: Sequence[Sequence[str]]) -> List[str]:
    """A folder name per run from the ``key=value`` overrides that differ between the runs: the
    last part of each key with its value, joined by ``-`` (``tp2-pp2-zero1``). A key whose last
    part is shared by another differing key keeps its full path. Names are unique (a clash or an
    empty name gets its index: ``run3``)."""
    keys = [[o.split("=", 1)[0] for o in ovs] for ovs in overrides]
    leaves: Dict[str, set] = {}
    for k in {k for ks in keys for k in ks}:
        leaves.setdefault(k.rsplit(".", 1)[-1], set()).add(k)
    names = []
    for i, ovs in enumerate(overrides):
        parts = []
        for o in ovs:
            k, _, v = o.partition("=")
            leaf = k.rsplit(".", 1)[-1]
            parts.append(_name_part(k, v, leaf if len(leaves[leaf]) == 1 else k.replace(".", "_")))
        name = "-".join(parts)[:MAX_NAME] or f"run{i}"
        names.append(name)
    seen: Dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    return [n if seen[n] == 1 else f"{n}-run{i}" for i, n in enumerate(names)]


def differing(cfgs: Sequence[Any]) -> List[List[str]]:
    """Per config, the ``key=value`` of every recipe key whose value differs between them (from
    the sweep's axes or the recipe's ``sweep:`` block alike)."""
    from paralayer.metrics.report import differing_overrides

    return differing_overrides([config_mod.to_dict(c) for c in cfgs])


def _write_json(path: str, data: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def write_metadata(sweep_dir: str, group: str, run_dirs: Sequence[str], names: Sequence[str],
                   overrides: Sequence[Sequence[str]], backend: str) -> None:
    """sweep.json in the sweep folder (the runs in order) and in each run folder (its index)."""
    runs = []
    for i, (d, n, o) in enumerate(zip(run_dirs, names, overrides)):
        meta = {"index": i, "count": len(run_dirs), "name": n, "overrides": list(o), "group": group,
                "sweep_dir": os.path.abspath(sweep_dir)}
        _write_json(os.path.join(d, SWEEP_FILE), meta)
        runs.append({"index": i, "name": n, "dir": os.path.relpath(d, sweep_dir), "overrides": list(o)})
    _write_json(os.path.join(sweep_dir, SWEEP_FILE), {"group": group, "backend": backend, "runs": runs})


def record_slurm(res: Any) -> None:
    """Each run's job id, log files and (after --wait) final state into its sweep.json, so the
    report can name a failed job's state and error line later."""
    states = getattr(res, "states", None) or {}
    for jid, d, errs in zip(res.job_ids, res.run_dirs, res.stderr):
        path = os.path.join(d, SWEEP_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
        meta["slurm"] = {"job_id": str(jid), "folder": res.folder, "stderr": list(errs),
                         **({"state": states[jid]} if jid in states else {})}
        _write_json(path, meta)


def report(sweep_dir: str, cfg: Any, file: Any = None) -> Optional[Any]:
    """Write and print the sweep's report; log it to the sweep's W&B group. A report that cannot
    be made is a warning, never a change to the sweep's exit status."""
    from paralayer.metrics import report as report_mod

    try:
        rep = report_mod.write([sweep_dir], sweep_dir, show=True, file=file)
    except Exception as exc:  # noqa: BLE001 - the runs are done; the report must not undo that
        print(f"paralayer: no sweep report ({type(exc).__name__}: {exc}); "
              f"try: python -m paralayer.report {sweep_dir}", file=sys.stderr, flush=True)
        return None
    wb = cfg.logging.wandb
    if wb.mode and wb.mode != "disabled":
        try:
            report_mod.log_to_wandb(rep, wb.mode, wb.project, wb.group, sweep_dir)
        except Exception as exc:  # noqa: BLE001
            print(f"paralayer: the report was not logged to W&B ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
    return rep
