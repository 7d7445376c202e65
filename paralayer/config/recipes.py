"""Where recipes and cluster profiles come from: a name is looked up in the user's own folders
first, then in the ones paralayer ships.

Why: paralayer installed from a wheel (or ``pip install git+...``, or into a container image)
has no source checkout around it, so the recipes, the cluster profiles and the local-SLURM
scripts ship inside the package (``paralayer/_recipes``, ``paralayer/_cluster``: setup.py maps
the repo's top-level ``recipes/`` and ``cluster/`` there); a source checkout reads them where they
are. A user adds or overrides one without touching either.

The order, first match wins (``recipe=NAME``; ``cluster=NAME`` the same with profiles):

1. a path: ``recipe=my/run.yaml`` (a ``.yaml``/``.yml`` file that exists; checked by the loader);
2. the working directory's ``recipes/`` (profiles: ``cluster/profiles/``);
3. the folders in ``PARALAYER_RECIPES`` (profiles: ``PARALAYER_PROFILES``), colon-separated, in
   order;
4. the shipped ones.

The variables are read only here, when the front door looks a NAME up; a rank never does (it
reads its run directory's resolved.yaml by path). ``python launch.py --help`` lists every recipe
with the folder it comes from.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import paralayer

#: kind -> (environment variable, the folder under the working directory, the shipped folder in
#: the package, the same folder in a source checkout relative to the repo root)
KINDS = {
    "recipes": ("PARALAYER_RECIPES", "recipes", "_recipes", "recipes"),
    "profiles": ("PARALAYER_PROFILES", "cluster/profiles", "_cluster/profiles", "cluster/profiles"),
}
SHIPPED = "shipped"


def _package_dir() -> Path:
    return Path(paralayer.__file__).resolve().parent


def shipped_dir(kind: str) -> Path:
    """The folder paralayer ships for ``kind``: inside the installed package (a wheel), else the
    source checkout's top-level folder (an editable install, or PYTHONPATH on a checkout)."""
    _, _, inside, checkout = KINDS[kind]
    pkg = _package_dir()
    wheel = pkg / inside
    return wheel if wheel.is_dir() else pkg.parent / checkout


def shipped_script(name: str) -> Path:
    """A shipped script of ``cluster/`` (``local_slurm.sh``, ``install_slurm_deps.sh``)."""
    pkg = _package_dir()
    wheel = pkg / "_cluster" / name
    return wheel if wheel.is_file() else pkg.parent / "cluster" / name


def search_dirs(kind: str) -> list[tuple[str, Path]]:
    """(where it comes from, folder) in lookup order; a folder seen twice counts once, and the
    shipped folder is called so even when it is also the working directory's (a checkout)."""
    env, local, _, _ = KINDS[kind]
    shipped = shipped_dir(kind)
    dirs = [(f"./{local}", Path.cwd() / local)]
    dirs += [(f"${env}", Path(p)) for p in os.environ.get(env, "").split(os.pathsep) if p.strip()]
    dirs.append((SHIPPED, shipped))
    out, seen = [], set()
    for label, d in dirs:
        try:
            key = d.resolve()
            if not d.is_dir() or key in seen:
                continue
        except (OSError, ValueError):
            continue
        seen.add(key)
        out.append((SHIPPED if key == shipped.resolve() else label, d))
    return out


def _names_in(d: Path) -> list[str]:
    try:
        return sorted(p.stem for p in d.glob("*.yaml") if p.is_file())
    except OSError:
        return []


def find(kind: str, name: str) -> Optional[Path]:
    """The file NAME.yaml of the first folder in lookup order that has it (None: none has)."""
    if not name or "/" in name or name.startswith("."):
        return None
    for _, d in search_dirs(kind):
        p = d / f"{name}.yaml"
        try:
            if p.is_file():
                return p
        except (OSError, ValueError):
            continue
    return None


def names(kind: str) -> list[str]:
    """Every NAME that ``find`` can answer, sorted."""
    return sorted({n for _, d in search_dirs(kind) for n in _names_in(d)})


def origins(kind: str) -> list[tuple[str, Path, list[str]]]:
    """(where from, folder, the names it provides) in lookup order; a name shadowed by an earlier
    folder is listed under that one only."""
    taken: set[str] = set()
    out = []
    for label, d in search_dirs(kind):
        own = [n for n in _names_in(d) if n not in taken]
        taken.update(own)
        if own:
            out.append((label, d, own))
    return out


def describe(kind: str) -> str:
    """One line per folder for ``--help``: ``  shipped (/path): a, b, c``."""
    return "\n".join(f"  {label} ({d}): {', '.join(own)}" for label, d, own in origins(kind))
