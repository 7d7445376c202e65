#!/usr/bin/env bash
# The wheel as a user gets it: build it from the tracked files, install it (not editable) into a
# fresh virtual environment, and from an empty directory run the front door's three promises:
#   paralayer --dry-run                                  (the shipped tiny recipe, resolved)
#   paralayer recipe=llama3-70b --plan --top 3           (the planner, shipped recipe and profile)
#   paralayer train.steps=3 ...                          (the tiny training, a few steps, ranks here)
# Any step that fails (a recipe or a data file missing from the wheel, the editable copy imported
# instead of the wheel's) fails the script. The venv sees the system's packages
# (--system-site-packages: torch and the rest are not downloaded again); the wheel's paralayer
# comes first on its path, which the script checks.
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
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/empty"
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

step "install it into a fresh venv"
python3 -m venv --system-site-packages --without-pip "$WORK/venv"  # this python's pip installs into it
python3 -m pip --python "$WORK/venv/bin/python" install -q --no-deps "$WHEEL"
PL="$WORK/venv/bin/paralayer"
cd "$WORK/empty"
WHERE=$("$WORK/venv/bin/python" -c 'import paralayer; print(paralayer.__file__)')
case "$WHERE" in
  "$WORK/venv/"*) echo "paralayer from $WHERE" ;;
  *) echo "error: the venv imports paralayer from $WHERE, not from the wheel" >&2; exit 1 ;;
esac

step "paralayer --dry-run"
"$PL" --dry-run > dry.txt
grep -q "valid" dry.txt

step "paralayer recipe=llama3-70b --plan --top 3"
"$PL" recipe=llama3-70b --plan --top 3 --json > plan.json
"$WORK/venv/bin/python" -c 'import json; d = json.load(open("plan.json")); rows = d["layouts"] if isinstance(d, dict) else d; assert 1 <= len(rows) <= 3, len(rows); print(len(rows), "layouts")'

step "the tiny training, 3 steps"
"$PL" train.steps=3 logging.wandb.mode=disabled run.dir="$WORK/empty/run"
"$WORK/venv/bin/python" - <<'EOF'
import json
rows = [json.loads(l) for l in open("run/metrics.jsonl") if l.strip()]
steps = [r["step"] for r in rows if "loss" in r]
assert steps[-1] == 3 and all(r["loss"] == r["loss"] for r in rows if "loss" in r), steps
print(f"trained {steps[-1]} steps, last loss {rows[-1]['loss']:.4f}")
EOF
step "ok"
