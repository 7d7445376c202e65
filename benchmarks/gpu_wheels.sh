#!/usr/bin/env bash
# Download, here, the wheels the lent GPU box lacks, for its Python 3.12 on manylinux x86-64, into
# .whl/ (ignored by git; benchmarks/gpu.sh installs them there into a target directory when an
# import is missing). What the box lacks: omegaconf, submitit, wandb and datasets, and whatever
# of their dependencies is not in the box's image (the list below is that image's, as recorded in
# the device notes). Versions are those installed here, so the box runs what CI runs.
# Usage: bash benchmarks/gpu_wheels.sh [DIR]   (default .whl; prints the total size, which must
# fit the 64 MiB a device call carries together with the working tree)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
mkdir -p "$DIR"
# name==version of every package to carry: the four roots and their requirements, recursively,
# minus what the box has (its image's package list, 2026-11-17).
mapfile -t WANT < <(python - <<'PY'
import re
from importlib import metadata

ROOTS = ["omegaconf", "submitit", "wandb", "datasets"]
BOX = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython einops equinox
filelock flatbuffers fonttools frozenlist fsspec grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig jinja2 joblib kiwisolver lxml markdown markdown-it-py markupsafe matplotlib mdurl
ml-dtypes mpmath msgpack multidict networkx ninja numpy packaging pandas pathspec pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest
pytest-timeout python-dateutil pyyaml regex requests rich safetensors scipy setuptools shellingham simplejson six
sortedcontainers sympy tabulate tokenizers toolz torch tqdm transformers triton typer typing-extensions
typing-inspect urllib3 werkzeug wheel wrapt xxhash yarl zipp""".split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
seen, todo = {}, list(ROOTS)
while todo:
    name = norm(todo.pop())
    if name in seen or name in BOX:
        continue
    dist = metadata.distribution(name)
    seen[name] = dist.version
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        if ";" in req and "python_version" in req and "< \"3.1" in req.replace("'", '"'):
            continue  # a backport for older Pythons than the box's 3.12
        todo.append(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
for name, version in sorted(seen.items()):
    print(f"{name}=={version}")
PY
)
echo "carrying ${#WANT[@]} packages: ${WANT[*]}"
rm -f "$DIR"/*.whl
PLAT=()
for n in 17 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DIR" "${WANT[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)
ls -1 "$DIR"
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "wheels: $((total / 1024)) KiB; tracked tree: $((tree / 1024)) KiB; together $(((total + tree) / 1048576)) MiB of the 64 MiB a call carries"
if (( total + tree > 60 * 1048576 )); then
    echo "too large to carry with the tree (keep 4 MiB spare for untracked files)" >&2
    exit 1
fi
