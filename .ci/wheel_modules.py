"""Run by .ci/wheel_check.sh under ``VENV/bin/python -I``: every module of the checkout is found in
the venv's installed copy, and nothing on sys.path or sys.meta_path leads to the checkout.

    python -I .ci/wheel_modules.py VENV REPO MODULES_TXT   (MODULES_TXT: git ls-files 'paralayer/*.py')

Exit 1 with one line naming what is missing or what leads to the checkout.
"""
import importlib.util
import os
import sys


def module_names(listing: str) -> list:
    names = set()
    for line in open(listing):
        parts = line.strip()[:-len(".py")].split("/")
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def main() -> int:
    venv, repo, listing = (os.path.realpath(a) for a in sys.argv[1:4])
    leads = [p for p in sys.path if p and os.path.realpath(p).startswith(repo + os.sep)]
    leads += [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()]
    if leads:
        print(f"error: the venv has a path to the checkout: {leads}", file=sys.stderr)
        return 1
    names = module_names(listing)
    missing = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else ""
        if not origin.startswith(venv + os.sep):
            missing.append(name if spec is None else f"{name} (from {spec.origin})")
    if missing:
        print(f"error: {len(missing)} of the checkout's {len(names)} modules are not in the wheel: "
              f"{', '.join(missing[:6])}", file=sys.stderr)
        return 1
    print(f"modules: all {len(names)} of the checkout's modules come from the wheel; no path to the checkout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
