"""Issue 16's contract, by property: any override of any schema field, and any recipe file, through
``launch.py --dry-run`` (and ``--plan``) ends in exit 0 or 2, never 3; an exit 2 prints an
``error:`` line naming the field typed (a YAML error: the file and line); resolving is bounded
(CPU seconds: the machine's other load does not count); ``--json`` is strict JSON; a planted
secret in the environment is never echoed.

In-process (``cli.main``) so a few hundred examples fit well under a minute on 2 cores.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paralayer import cli
from paralayer.config import all_keys
from tests.cpu_budget import machine_scale

SECRET = "sk_PROPERTY_0b9e6d2c41"
SECTIONS = {"model", "model.moe", "parallel", "train", "data", "cluster", "cluster.slurm", "checkpoint", "run",
            "logging", "logging.wandb"}
LEAVES = sorted(k for k in all_keys() if k not in SECTIONS)
#: a memory overflow is caused jointly: the "memory:" line names these through the parts it explains
MEMORY = ("model.", "parallel.", "train.micro_batch", "train.global_batch", "train.precision", "cluster.")

NUMBERS = st.one_of(
    st.integers(-5, 70), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([2 ** 63, 2 ** 64, 10 ** 30, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0, 5e-324]),
).map(str)
TEXTS = st.one_of(
    st.sampled_from(["", "null", "~", "abc", "true", "[1]", "[1, [2]]", "{a: 1}", "{", "[", "???", "auto", "0x10",
                     "1_000", "'5'", "é☃", "--", "=", "hf:/nonexistent", "${model.d_model}", "${nope.x}",
                     "${model}", "${..d_model}", "${model.d_model", "$WANDB_API_KEY"]),
    st.sampled_from(["${oc.env:WANDB_API_KEY}", "${oc.env:WANDB_API_KEY,x}", "pre-${oc.env:WANDB_API_KEY}",
                     "${oc.decode:'1'}", "${oc.create:{a: 1}}", "${oc.select:model.d_model}"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20),
    st.integers(250, 5000).map(lambda n: "a" * n),
)
VALUES = st.one_of(NUMBERS, TEXTS)
RECIPES = st.sampled_from(["tiny", "tiny", "tiny-pp", "tiny-moe", "llama3-8b", "mixtral-8x7b"])


def _run(argv: list[str]) -> tuple[int, float, str, str]:
    """One in-process call and its CPU seconds. The collector is off meanwhile: the worker's heap after
    hundreds of other tests is not the command's cost (and no gc.collect() first: on that heap it costs
    more than the command; 7 Dec, a collect per call took the file from ~40 s to 380 s)."""
    out, err = io.StringIO(), io.StringIO()
    gc.disable()
    try:
        t0 = time.process_time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
        took = time.process_time() - t0
    finally:
        gc.enable()
    return rc, took, out.getvalue(), err.getvalue()


def _bounded(argv: list[str], bound_s: float) -> tuple[int, float, float, str, str]:
    """`_run`, held to `bound_s` CPU seconds: over it, the better of two runs against the bound scaled to
    this machine now (CI read 1.50 s once on 6 Dec, 1.0065 s at load 12 and 1.09 s once for a 0.03 s
    command on 7 Dec: another thread of the worker, not the command). Returns rc, cpu, bound, out, err."""
    rc, cpu, out, err = _run(argv)
    if cpu >= bound_s:
        cpu, bound_s = min(cpu, _run(argv)[1]), bound_s * machine_scale()
    return rc, cpu, bound_s, out, err


def _strict(text: str) -> None:
    def refuse(c):
        raise ValueError(f"bare {c} is not JSON")

    json.loads(text, parse_constant=refuse)


def _names(err: str, key: str) -> bool:
    if key in err:
        return True
    return "error: memory:" in err and key.startswith(MEMORY)


@pytest.fixture(autouse=True, scope="module")
def _planted_secret_and_warm():
    """The secret planted for the module; one call per mode first, so one-time imports (rich, the
    planner) do not count against the bound."""
    old = os.environ.get("WANDB_API_KEY")
    os.environ["WANDB_API_KEY"] = SECRET
    for argv in (["--dry-run"], ["--dry-run", "--json"], ["--plan", "--json"], ["parallel.tp=3", "--dry-run"]):
        _run(["recipe=tiny", *argv])
    yield
    if old is None:
        os.environ.pop("WANDB_API_KEY", None)
    else:
        os.environ["WANDB_API_KEY"] = old


def _check(argv: list[str], key: str, bound_s: float) -> None:
    rc, cpu, bound_s, out, err = _bounded(argv, bound_s)
    assert rc in (0, 2), (argv, rc, err[-500:])
    assert cpu < bound_s, (argv, cpu, bound_s)
    assert SECRET not in out + err, argv
    assert "Traceback" not in err
    if "--json" in argv and out.strip():
        _strict(out)
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert lines, (argv, err)
        assert _names(err, key), (argv, err[-600:])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=RECIPES, key=st.sampled_from(LEAVES), value=VALUES, as_json=st.booleans())
def test_any_override_of_any_field_exits_0_or_2_naming_it(recipe, key, value, as_json):
    argv = [f"recipe={recipe}", f"{key}={value}", "--dry-run"] + (["--json"] if as_json else [])
    _check(argv, key, bound_s=1.0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(LEAVES), value=VALUES)
def test_plan_is_bounded_and_names_the_field(key, value):
    _check(["recipe=tiny", f"{key}={value}", "--plan", "--json"], key, bound_s=5.0)


def _yaml_value(v: str) -> str:
    return json.dumps(v) if any(c in v for c in "{}[]:#,&*!|>'\"%@`") or v.strip() != v or not v else v


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(LEAVES), value=st.one_of(VALUES, st.sampled_from(["[1, 2]", "{x: 1}"])),
       quoted=st.booleans())
def test_any_recipe_file_exits_0_or_2_naming_the_field(key, value, quoted):
    parts = key.split(".")
    lines, ind = ["base: tiny"], ""
    for p in parts[:-1]:
        lines.append(f"{ind}{p}:")
        ind += "  "
    lines.append(f"{ind}{parts[-1]}: {_yaml_value(value) if quoted else value}")
    fd, path = tempfile.mkstemp(suffix=".yaml")
    try:
        os.write(fd, ("\n".join(lines) + "\n").encode())
        os.close(fd)
        argv = [f"recipe={path}", "--dry-run"]
        rc, cpu, bound_s, out, err = _bounded(argv, 1.0)
        assert rc in (0, 2), (lines, rc, err[-500:])
        assert cpu < bound_s and SECRET not in out + err, (lines, cpu, bound_s)
        if rc == 2:
            # the field, or for a YAML syntax error the file and its line
            assert _names(err, key) or (path in err and " line " in err), (lines, err[-600:])
    finally:
        os.unlink(path)


# ------------------------------------------------------------------ issue 28: the second pass
CONTAINER_FIELDS = ["parallel.pp_layout", "cluster.slurm.sbatch_extra", "cluster.slurm.srun_args", "sweep",
                    "model", "model.moe", "parallel", "run.name", "train.lr", "cluster.slurm.setup"]
CONTROL = st.sampled_from(["\n", "\r", "\x1b[31m", "\x1b]0;t\x07", "\t", "\x7f", "\u2028", "\x85", "\x0b", "\x1b[2J"])


def _nested(depth: int, kinds: list[str]) -> str:
    text = "1"
    for i in range(depth):
        text = f"{{a: {text}}}" if kinds[i % len(kinds)] == "map" else f"[{text}]"
    return text


def _one_line_errors(err: str) -> None:
    assert "\x1b" not in err
    for ln in err.splitlines():
        assert ln.startswith(("error:", "warning:", "note:", "usage:")) or not ln.strip(), ln


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(CONTAINER_FIELDS), depth=st.integers(1, 400),
       kinds=st.lists(st.sampled_from(["map", "list"]), min_size=1, max_size=3), in_file=st.booleans())
def test_any_nesting_depth_exits_0_or_2_naming_the_field_or_file(key, depth, kinds, in_file):
    value = _nested(depth, kinds)
    if not in_file:
        _check(["recipe=tiny", f"{key}={value}", "--dry-run"], key.split(".")[0], bound_s=1.0)
        return
    parts = key.split(".")
    text = "base: tiny\n" + "".join("  " * i + p + ":\n" for i, p in enumerate(parts[:-1]))
    text += "  " * (len(parts) - 1) + f"{parts[-1]}: {value}\n"
    fd, path = tempfile.mkstemp(suffix=".yaml")
    try:
        os.write(fd, text.encode())
        os.close(fd)
        rc, cpu, bound_s, out, err = _bounded([f"recipe={path}", "--dry-run"], 1.0)
        assert rc in (0, 2) and cpu < bound_s, (key, depth, rc, cpu, bound_s, err[-300:])
        if rc == 2:
            assert _names(err, key.split(".")[0]) or path in err, err
        _one_line_errors(err)
    finally:
        os.unlink(path)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(CONTAINER_FIELDS), swap=st.sampled_from(["{a: 1}", "[1, 2]", "[[1]]", "[{a: 1}]",
                                                                    "{a: [1, {b: 2}]}", "x"]))
def test_any_container_type_swap_exits_0_or_2_naming_the_field(key, swap):
    _check(["recipe=tiny", f"{key}={swap}", "--dry-run"], key.split(".")[0], bound_s=1.0)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(top=st.one_of(st.integers(101, 10 ** 6), st.integers(10 ** 6, 10 ** 30)), as_json=st.booleans())
def test_a_huge_top_is_capped_within_the_bound(top, as_json):
    argv = ["recipe=tiny", "--plan", "--top", str(top)] + (["--json"] if as_json else [])
    rc, cpu, bound_s, out, err = _bounded(argv, 2.0)
    assert rc == 0 and "capped at" in err and cpu < bound_s
    if as_json:
        _strict(out)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.integers(1, 40), b=st.integers(1, 40), keys=st.sampled_from([("train.seed", "train.steps"),
                                                                        ("run.name", "train.seed"),
                                                                        ("train.lr", "checkpoint.every")]))
def test_sweep_products_at_the_bound_are_fast_or_refused_naming_an_axis(a, b, keys):
    vals = {"train.seed": [str(i) for i in range(b)], "train.steps": [str(i + 1) for i in range(a)],
            "run.name": [f"r{i}" for i in range(a)], "train.lr": [f"{(i + 1) * 1e-4:g}" for i in range(a)],
            "checkpoint.every": [str(i) for i in range(b)]}
    argv = ["recipe=tiny", "-m", "--dry-run"] + [f"{k}={','.join(vals[k] or ['1'])}" for k in keys]
    rc, cpu, bound_s, out, err = _bounded(argv, 2.0)
    n = max(len(vals[keys[0]]), 1) * max(len(vals[keys[1]]), 1)
    assert rc in (0, 2) and cpu < bound_s, (n, cpu, bound_s, err[-300:])
    if n > cli.MAX_SWEEP:
        assert rc == 2 and "at most 256" in err and any(k in err for k in keys)
    elif n > 1 and rc == 0:
        assert out.startswith(f"sweep: {n} run(s)")
    _one_line_errors(err)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(LEAVES + ["recipe", "cluster", "nokey.x"]), pre=st.text(max_size=4), c=CONTROL,
       post=st.text(max_size=4))
def test_a_value_with_control_characters_stays_on_one_escaped_line(key, pre, c, post):
    value = (pre + c + post).replace("\x00", "")
    rc, cpu, bound_s, out, err = _bounded([f"{key}={value}", "--dry-run"], 1.0)
    assert rc in (0, 2) and cpu < bound_s, (key, value, cpu, bound_s)
    assert "\x1b" not in out + err
    _one_line_errors(err)
