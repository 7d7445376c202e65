#!/usr/bin/env bash
# The wheel as a user gets it, and the wheel alone: build it from the tracked files, install it (not
# editable) into a fresh virtual environment that has NO path to the checkout, and from an empty
# directory run the front door's three promises:
#   paralayer --dry-run                                  (the shipped tiny recipe, resolved)
#   paralayer recipe=llama3-70b --plan --top 3           (the planner, shipped recipe and profile)
#   paralayer train.steps=3 ...                          (the tiny training, a few steps, ranks here)
# Any step that fails (a recipe, a data file or a module missing from the wheel) fails the script.
#
# No path to the checkout (issue #37): the system's site-packages holds this checkout's editable
# finder (a .pth file), and a venv made with --system-site-packages runs it, so a subpackage missing
# from the wheel was imported from the checkout without an error. Here the venv is plain; one .pth
# line puts the system's site-packages on its path for torch and the rest (a directory added by a
# .pth line does not get its own .pth files run: no editable finder), PYTHONPATH is unset, the
# checks run under `python -I` from an empty folder, and every module of the checkout must be found
# in the venv's copy. The check is itself checked: a copy of the wheel without paralayer/rehearse/
# is installed into a second venv, and the module check must fail there.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/paralayer-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH PARALAYER_RECIPES PARALAYER_PROFILES
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

step() { echo "== wheel: $* ($((SECONDS - T0)) s)"; }

step "build from the tracked files"
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/empty" "$WORK/planted"
git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$WORK/src")
# setuptools >= 71 builds wheels itself (no `wheel` package): build with it, offline
if python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null; then
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src"
else
  python3 -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
fi
WHEEL=$(ls "$WORK"/dist/paralayer-*.whl)
python3 - "$WHEEL" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["paralayer/_recipes/tiny.yaml", "paralayer/_recipes/llama3-70b.yaml", "paralayer/_cluster/profiles/local.yaml",
        "paralayer/_cluster/local_slurm.sh", "paralayer/_cluster/install_slurm_deps.sh"]
missing = [n for n in need if n not in names]
assert not missing, f"the wheel lacks {missing}"
print(f"wheel: {len(names)} files, recipes {sum(n.startswith('paralayer/_recipes/') for n in names)}")
EOF
git -C "$REPO" ls-files 'paralayer/*.py' > "$WORK/modules.txt"

# make_venv DIR WHEEL: a plain venv (no system site-packages, so no .pth of the system runs) whose
# path reaches the system's packages through one .pth line; WHEEL installed into it, not editable
make_venv() {
  python3 -m venv --without-pip "$1"
  local site
  site=$("$1/bin/python" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -I -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_system_packages.pth"
  python3 -m pip --python "$1/bin/python" install -q --no-deps "$2"
}

# check_modules DIR: every module of the checkout's paralayer/ is found in DIR's installed copy, and
# nothing on the path or among the import hooks leads to the checkout (python -I, the empty folder)
check_modules() {
  (cd "$WORK/empty" && "$1/bin/python" -I "$REPO/.ci/wheel_modules.py" "$1" "$REPO" "$WORK/modules.txt")
}

step "install it into a fresh venv"
make_venv "$WORK/venv" "$WHEEL"
PL="$WORK/venv/bin/paralayer"
cd "$WORK/empty"
WHERE=$("$WORK/venv/bin/python" -I -c 'import paralayer; print(paralayer.__file__)')
case "$WHERE" in
  "$WORK/venv/"*) echo "paralayer from $WHERE" ;;
  *) echo "error: the venv imports paralayer from $WHERE, not from the wheel" >&2; exit 1 ;;
esac
check_modules "$WORK/venv"

step "planted: the same check on a copy of the wheel without paralayer/rehearse/ must fail"
PLANTED="$WORK/planted/$(basename "$WHEEL")"
python3 - "$WHEEL" "$PLANTED" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:3]
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    for item in zi.infolist():
        if item.filename.startswith("paralayer/rehearse/"):
            continue
        data = zi.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"paralayer/rehearse/"))
        zo.writestr(item, data)
EOF
make_venv "$WORK/venv-planted" "$PLANTED"
if check_modules "$WORK/venv-planted" > "$WORK/planted.log" 2>&1; then
  cat "$WORK/planted.log"
  echo "error: the module check passed a wheel without paralayer/rehearse/: it cannot see the wheel alone" >&2
  exit 1
fi
grep -q "paralayer.rehearse" "$WORK/planted.log" || { cat "$WORK/planted.log"; exit 1; }
echo "planted: refused: $(tail -1 "$WORK/planted.log" | cut -c1-160)"
cd "$WORK/empty"

step "paralayer --dry-run"
"$PL" --dry-run > dry.txt
grep -q "valid" dry.txt

step "paralayer recipe=llama3-70b --plan --top 3"
"$PL" recipe=llama3-70b --plan --top 3 --json > plan.json
"$WORK/venv/bin/python" -I -c 'import json; d = json.load(open("plan.json")); rows = d["layouts"] if isinstance(d, dict) else d; assert 1 <= len(rows) <= 3, len(rows); print(len(rows), "layouts")'

step "the tiny training, 3 steps"
"$PL" train.steps=3 logging.wandb.mode=disabled run.dir="$WORK/empty/run"
"$WORK/venv/bin/python" -I - <<'EOF'
import json
rows = [json.loads(l) for l in open("run/metrics.jsonl") if l.strip()]
steps = [r["step"] for r in rows if "loss" in r]
assert steps[-1] == 3 and all(r["loss"] == r["loss"] for r in rows if "loss" in r), steps
print(f"trained {steps[-1]} steps, last loss {rows[-1]['loss']:.4f}")
EOF
step "ok"
