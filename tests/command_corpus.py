"""The generated corpus of bad input for every command of the README's command table (issue 35):
prepare, report, export, resubmit and slurm, beside the front door's (front_door_corpus.py).

    python tests/front_door_corpus.py --commands [--n 400] [--seed 0] [--kinds prepare-out,...]

Each case sets up a scratch folder (files, links, FIFOs: a run folder, a profile, a checkpoint, a
corpus) and runs ``paralayer CMD ...`` in a forked child (cli.main; the parent's imports are
shared, so a case costs milliseconds, and a SIGSEGV or a hang is a finding, not the end of the
run). Checked per case: the exit code is one the table documents (0, 2; report also 1) and never a
signal or a time-out; no traceback and no "unexpected" (a bug) line; an exit 2 prints one
``error:`` line that names an argument, a field or a file; no ANSI escape, and the planted secret
(in the environment, reached through /proc/self/environ links) appears neither in the output nor
in any file written (token ids of a shard decoded too); every file the case set up is
byte-identical afterwards and still there.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import resource
import select
import signal
import sys
import time
from typing import Callable, Iterator

from front_door_corpus import echo_problems, error_lines  # the tests folder is on sys.path for both corpora

SECRET = "sk_CORPUS_7f3a9c11e2"
#: a case that has not ended after this many wall seconds is a time-out (the machine is shared)
WALL_S = 60.0
#: the arguments and fields a command's rejection may begin with
ARGS = ("INPUT", "--out", "--format", "--text-field", "--tokenizer", "--workers", "--part-docs", "DIR", "RUN_DIR",
        "--checkpoint", "checkpoint.dir", "--profile", "--folder", "--entry", "--timeout-s", "--nodes", "--wandb",
        "slurm", "--no-progress", "--wait")
#: exit codes each command documents (README's command table)
EXITS = {"prepare": (0, 2), "report": (0, 1, 2), "export": (0, 2), "resubmit": (0, 2), "slurm": (0, 2)}
CONTROL = ["\n", "\x1b[31m", "\r", "\x7f", "\u2028", "\t"]


class Case:
    """``argv`` for ``paralayer``, with ``{t}`` for the scratch folder; ``files`` (text or bytes),
    ``links`` (name -> target), ``fifos``: what is set up (and protected) before it runs."""

    def __init__(self, kind: str, argv: list[str], files: dict | None = None, links: dict | None = None,
                 fifos: list | None = None):
        self.kind, self.argv = kind, argv
        self.files, self.links, self.fifos = files or {}, links or {}, fifos or []


DOCS = "the first document\nthe second one\nand a third\n"


def _run_folder(r: random.Random, broken: str | None = None) -> dict:
    """A run folder's files (``run/``), with one of them broken in one of the ways a shared file
    system or a crash leaves them."""
    files = {"run/plan.json": json.dumps({"world_size": 1, "bubble_fraction": 0.0}),
             "run/resolved.yaml": "recipe: tiny\ntrain:\n  steps: 2\n",
             "run/metrics.jsonl": '{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.0}\n'}
    deep = "[" * 5000 + "]" * 5000
    bad = {"plan-type": ("run/plan.json", r.choice(['{"bubble_fraction": "x"}', '{"memory_per_device_bytes": 5}',
                                                     "[1, 2]", '"text"', '{"step_time_s": true}', '{"mfu": [1]}'])),
           "plan-deep": ("run/plan.json", '{"a": ' + deep + "}"),
           "plan-binary": ("run/plan.json", b"\xff\xfe\x00{"),
           "metrics-binary": ("run/metrics.jsonl", b'{"step": 1}\n\x00\xff\xfebinary\n'),
           "metrics-utf16": ("run/metrics.jsonl", '{"step": 1, "loss": 2.0}\n'.encode("utf-16")),
           "metrics-text-loss": ("run/metrics.jsonl", '{"step": 1, "loss": "five"}\n'),
           "metrics-deep": ("run/metrics.jsonl", '{"step": 1, "x": ' + deep + "}\n"),
           "metrics-long": ("run/metrics.jsonl", '{"step": 1, "s": "' + "x" * (1 << 21) + '"}\n'),
           "sweep-type": ("run/sweep.json", r.choice(['{"index": "x"}', '{"runs": 5}', '{"overrides": [1]}',
                                                      '{"slurm": {"stderr": [5]}}', "[]", '{"slurm": "x"}'])),
           "yaml-garbage": ("run/resolved.yaml", r.choice(["train: [\n", "- a\n- b\n", "train: {steps: x}\n",
                                                           "a: &a [*a]\n", "train: 5\n"])),
           "name-control": ("run/sweep.json", json.dumps({"name": f"n{r.choice(CONTROL)}m",
                                                          "overrides": [f"a{r.choice(CONTROL)}=1"]}))}
    if broken in bad:
        name, text = bad[broken]
        files[name] = text
    return files


def gen_prepare_out(r: random.Random) -> Case:
    out = r.choice(["", ".", "sub/", ".hidden", "-", "o\u202ep", "{t}/in.txt/x", "/sys/x", "/proc/x", "a" * 300,
                    "{t}/" + "d/" * 3 + "b" * 256, f"o{r.choice(CONTROL)}p", "{t}/in", "/dev/null/x", "..", "{t}/"])
    return Case("prepare-out", ["prepare", "{t}/in.txt", "--out", out, "--workers", "1", "--no-progress"],
                files={"in.txt": DOCS})


def _parquet(columns: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


def gen_prepare_input(r: random.Random) -> Case:
    kind = r.choice(["environ", "fifo", "zero", "dir-link", "nul", "int-text", "deep-jsonl", "binary-shard", "missing",
                     "control-name", "empty", "utf16", "not-json", "list-doc", "list-line", "int-parquet",
                     "mixed-parquet"])
    files, links, fifos, fmt, inp = {"ok.txt": DOCS}, {}, [], "text", "{t}/x.txt"
    if kind == "environ":
        links["x.txt"] = "/proc/self/environ"
    elif kind == "fifo":
        fifos.append("x.txt")
    elif kind == "zero":
        links["x.txt"] = "/dev/zero"
    elif kind == "dir-link":
        files["c/a.txt"] = DOCS
        links["c/b.txt"] = "/proc/self/environ"
        inp = "{t}/c"
    elif kind == "nul":
        files["x.txt"] = b"a doc\x00with a NUL\n"
    elif kind == "int-text":
        files["x.txt"], fmt = '{"text": "a"}\n{"text": 5}\n', "jsonl"
    elif kind == "deep-jsonl":
        files["x.txt"], fmt = '{"text": ' + "[" * r.choice([40, 1000, 100000]) + "]" * r.choice([1, 3]) + "}\n", "jsonl"
    elif kind == "binary-shard":
        files["x.txt"] = bytes(range(256)) * 4
    elif kind == "control-name":
        inp = "{t}/x" + r.choice(CONTROL) + "y.txt"
    elif kind == "empty":
        files["x.txt"] = ""
    elif kind == "utf16":
        files["x.txt"] = DOCS.encode("utf-16")
    elif kind == "not-json":
        files["x.txt"], fmt = "{not json\n", "jsonl"
    elif kind in ("list-doc", "list-line"):  # enough rows for the workers of datasets.map
        bad = '{"text": ["a", "list"]}' if kind == "list-doc" else "[1, 2, 3]"
        files["x.txt"], fmt = '{"text": "a doc"}\n' * r.choice([3, 40]) + bad + "\n", "jsonl"
    elif kind == "int-parquet":
        files["x.txt"], fmt = _parquet({"text": list(range(r.choice([1, 50])))}), "parquet"
    elif kind == "mixed-parquet":
        files["c/a.parquet"] = _parquet({"text": ["a doc", "another"]})
        files["c/b.parquet"] = _parquet(r.choice([{"text": [1, 2]}, {"body": ["x"]}, {"text": ["x"], "n": [1]}]))
        inp, fmt = "{t}/c", "parquet"
    workers = "2" if kind.startswith("list") else "1"
    argv = ["prepare", inp, "--out", "{t}/o", "--format", fmt, "--workers", workers, "--no-progress"]
    return Case("prepare-input", argv,
                files=files, links=links, fifos=fifos)


def gen_prepare_loss(r: random.Random) -> Case:
    """Its own inputs as outputs, a parts folder it did not make, bad flags."""
    kind = r.choice(["self", "parts-input", "foreign-parts", "bad-manifest", "other-key", "flags", "tokenizer"])
    files = {"x.bin": DOCS, "in.txt": DOCS}
    argv = ["prepare", "{t}/in.txt", "--out", "{t}/o", "--workers", "1", "--no-progress"]
    if kind == "self":
        argv[1], argv[3] = "{t}/x.bin", "{t}/x"
    elif kind == "parts-input":
        files["corp.parts/a.txt"] = DOCS
        argv[1], argv[3] = "{t}/corp.parts", "{t}/corp"
    elif kind == "foreign-parts":
        files["o.parts/notes.txt"] = "mine"
    elif kind == "bad-manifest":
        files["o.parts/manifest.json"] = r.choice(["{bad", "[1]", '{"v": 1}', "[" * 5000])
        files["o.parts/part-00000.idx"] = b"garbage"
    elif kind == "other-key":
        files["o.parts/manifest.json"] = json.dumps({"v": 1, "files": [], "format": "text"})
    elif kind == "flags":
        argv += r.choice([["--workers", "0"], ["--part-docs", "-1"], ["--workers", "x"], ["--format", "csv"],
                          ["--bogus"], ["--part-docs", "0"]])
    elif kind == "tokenizer":
        files["tok.json"] = r.choice(["{}", "garbage", "[" * 3000])
        argv += ["--tokenizer", r.choice(["{t}/tok.json", "/proc/self/environ", "{t}/none.json", "/dev/zero"])]
    return Case("prepare-loss", argv, files=files)


def gen_report(r: random.Random) -> Case:
    broken = r.choice(["plan-type", "plan-deep", "plan-binary", "metrics-binary", "metrics-utf16", "metrics-text-loss",
                       "metrics-deep", "metrics-long", "sweep-type", "yaml-garbage", "name-control", "environ-error",
                       "fifo-log", "slurm-log", "out", None])
    files, links, fifos = _run_folder(r, broken), {}, []
    argv = ["report", "{t}/run", "--out", "{t}/rep"]
    if broken == "environ-error":
        links["run/error.txt"] = "/proc/self/environ"
    elif broken == "fifo-log":
        fifos.append("run/error.txt")
    elif broken == "slurm-log":
        files["run/sweep.json"] = json.dumps({"slurm": {"job_id": "9", "state": "FAILED",
                                                        "stderr": [r.choice(["/proc/self/environ", "/dev/zero",
                                                                             "{t}/log-link"])]}})
        links["log-link"] = "/proc/self/environ"
    elif broken == "out":
        argv[-1] = r.choice(["", ".", "{t}/run/plan.json/x", "/sys/x", "x/"])
    if r.random() < 0.1:
        argv = ["report", r.choice(["{t}/none", "/proc", "{t}/run/plan.json", ""])]
    return Case("report", argv, files=files, links=links, fifos=fifos)


def gen_export(r: random.Random) -> Case:
    kind = r.choice(["no-run", "no-yaml", "yaml-garbage", "yaml-environ", "no-ckpt", "bad-ckpt", "out", "ckpt-arg"])
    files, links = {"run/resolved.yaml": "recipe: tiny\n"}, {}
    argv = ["export", "{t}/run", "--out", "{t}/hf"]
    if kind == "no-run":
        argv[1] = r.choice(["{t}/none", "/proc/self", "", "{t}/run/resolved.yaml"])
    elif kind == "no-yaml":
        files = {"run/x": "1"}
    elif kind == "yaml-garbage":
        files["run/resolved.yaml"] = r.choice(["model: [\n", "[1]", "model: {d_model: x}\n", "a: " + "[" * 500])
    elif kind == "yaml-environ":
        files, links = {}, {"run/resolved.yaml": "/proc/self/environ"}
    elif kind == "bad-ckpt":
        files["run/checkpoints/step-00000002/COMPLETE"] = r.choice(["{bad", "[1]", '{"format": 2, "files": 5}'])
        files["run/checkpoints/step-00000002/.metadata"] = b"\x80garbage"
    elif kind == "out":
        argv[3] = r.choice(["", ".", "{t}/run/resolved.yaml/x", "/proc/x", "{t}/run", "h/"])
    elif kind == "ckpt-arg":
        argv += ["--checkpoint", r.choice(["{t}/none", "/proc/self", "{t}/run/resolved.yaml"])]
    return Case("export", argv, files=files, links=links)


def gen_resubmit(r: random.Random) -> Case:
    files = {"run/resolved.yaml": "recipe: tiny\n", "run/plan.json": "{}"}
    links = {}
    prof = r.choice(["garbage: [\n", "[1, 2]", "nodes: many\n", "devices_per_node: [1]\n", "nodez: 1\n",
                     "cluster: {nodes: -3}\n", "a: " + "[" * 600, "slurm: {time_min: x}\n", "", "\x00\x01binary"])
    files["p.yaml"] = prof
    where = r.choice(["{t}/p.yaml", "/dev/zero", "../../../../etc/passwd", "{t}/env.yaml", "no-such-profile", ""])
    links["env.yaml"] = "/proc/self/environ"
    run = r.choice(["{t}/run", "{t}/none", "/proc/self"])
    return Case("resubmit", ["resubmit", run, "--profile", where], files=files, links=links)


def gen_slurm(r: random.Random) -> Case:
    action = r.choice(["start", "stop", "status", "env", "restart", "install-deps", "kill-node", "x\x1b[2J", ""])
    extra = r.choice([["--nodes"], ["--nodes", "99999999999999999999"], ["--nodes", "0"], ["--nodes=-1"],
                      ["--nodes", "x"], ["--nodes", "13"], ["extra"], ["--nodes", "1", "--nodes"], ["--nodes", "1e3"]])
    return Case("slurm", ["slurm", "--dry-run", action, *extra] if action else ["slurm", "--dry-run", *extra])


GENERATORS: dict[str, Callable[[random.Random], Case]] = {
    "prepare-out": gen_prepare_out, "prepare-input": gen_prepare_input, "prepare-loss": gen_prepare_loss,
    "report": gen_report, "export": gen_export, "resubmit": gen_resubmit, "slurm": gen_slurm,
}


def cases(n: int, seed: int = 0, kinds: list[str] | None = None) -> Iterator[Case]:
    from front_door_corpus import cases as drawn

    return drawn(n, seed, kinds, GENERATORS)


# ------------------------------------------------------------------ running one case
def _setup(case: Case, tmp: str) -> None:
    for rel, content in case.files.items():
        p = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
    for rel, target in case.links.items():
        p = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.symlink(target.replace("{t}", tmp), p)
    for rel in case.fifos:
        p = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.mkfifo(p)


def _snapshot(tmp: str) -> dict:
    """{path: sha256 | 'link -> target' | 'fifo'} of everything under ``tmp``."""
    out = {}
    for d, dirs, files in os.walk(tmp):
        for n in dirs + files:
            p = os.path.join(d, n)
            if os.path.islink(p):
                out[p] = "link -> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[p] = hashlib.sha256(f.read()).hexdigest()
            elif not os.path.isdir(p):
                out[p] = "special"
    return out


def _secret_in(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError:
        return False
    if SECRET.encode() in data:
        return True
    if path.endswith(".bin") and len(data) % 2 == 0:  # a shard of byte-level token ids (uint16)
        import numpy as np

        return SECRET.encode() in np.frombuffer(data, np.uint16).astype(np.uint8).tobytes()
    return False


def _child(argv: list[str], wfd_out: int, wfd_err: int, cwd: str) -> None:
    import faulthandler

    from paralayer import cli

    os.chdir(cwd)  # relative names (--out -) land in the scratch folder, never in the checkout
    faulthandler.disable()  # a signal is the parent's finding, not a dump on the test's terminal
    os.dup2(wfd_out, 1)
    os.dup2(wfd_err, 2)
    sys.stdout, sys.stderr = io.TextIOWrapper(os.fdopen(1, "wb", 0), write_through=True), \
        io.TextIOWrapper(os.fdopen(2, "wb", 0), write_through=True)
    code = 99
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 98
    except BaseException:  # noqa: BLE001 - a traceback is a finding
        import traceback

        traceback.print_exc()
        code = 97
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 96)


def run_case(case: Case, tmp: str) -> dict:
    """One case in a forked child: exit status, wall seconds, output, and what is wrong."""
    _setup(case, tmp)
    argv = [a.replace("{t}", tmp) for a in case.argv]
    before = _snapshot(tmp)
    outs = [os.pipe(), os.pipe()]
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(outs[0][0])
        os.close(outs[1][0])
        os.environ["WANDB_API_KEY"] = SECRET
        _child(argv, outs[0][1], outs[1][1], tmp)
    os.close(outs[0][1])
    os.close(outs[1][1])
    bufs, open_fds, status, timed_out = {outs[0][0]: b"", outs[1][0]: b""}, {outs[0][0], outs[1][0]}, None, False
    while open_fds:
        left = WALL_S - (time.monotonic() - t0)
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(left, 1.0))
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                bufs[fd] += chunk[: max(0, (1 << 20) - len(bufs[fd]))]
            else:
                open_fds.discard(fd)
    _, status, usage = os.wait4(pid, 0)
    for fd in bufs:
        os.close(fd)
    wall = time.monotonic() - t0
    o, e = (bufs[outs[0][0]].decode("utf-8", "replace"), bufs[outs[1][0]].decode("utf-8", "replace"))
    rc = os.waitstatus_to_exitcode(status)
    cmd = argv[0]
    problems = []
    if timed_out:
        problems.append(f"time-out after {WALL_S:.0f} s")
    elif rc < 0:
        problems.append(f"crash: signal {-rc}")
    elif rc not in EXITS.get(cmd, (0, 2)):
        problems.append(f"crash: exit {rc}")
    if "Traceback" in e or "unexpected " in e:
        problems.append("crash: traceback or unexpected exception")
    problems += echo_problems(o + e, SECRET)
    if rc == 2:
        lines, errs = error_lines(e)
        if len(errs) != 1 or any(not ln.startswith(("error:", "warning:", "note:")) for ln in lines):
            problems.append("multi-line: a message spans lines")
        elif not names_something(errs[0], tmp, argv):
            problems.append("unnamed: rejection names no argument, field or file")
    after = _snapshot(tmp)
    for p, h in before.items():
        if after.get(p) != h:
            problems.append(f"lost: {os.path.relpath(p, tmp)} {'changed' if p in after else 'gone'}")
    for p in after:
        if p not in before and after[p] not in ("special",) and not after[p].startswith("link") and _secret_in(p):
            problems.append(f"secret written into {os.path.relpath(p, tmp)}")
    return {"kind": case.kind, "argv": argv, "rc": rc, "cpu": usage.ru_utime + usage.ru_stime, "wall": wall,
            "err": e[-300:], "problems": problems}


def names_something(line: str, tmp: str, argv: list[str] = ()) -> bool:
    """``error: ARG: ...`` for an argument or field of ARGS or the schema, an argument as typed
    (``--bogus``), or a file under tmp."""
    from paralayer.config import all_keys

    head = line[len("error:"):].strip().split(": ", 1)[0]
    token = head.split(" ", 1)[0]
    return (token in ARGS or token in set(all_keys()) or token.startswith(("cluster.", "slurm")) or tmp in head
            or (token.startswith("-") and token in argv))


def main(n: int, seed: int, kinds: list[str] | None, show: int) -> int:
    import tempfile

    import torch  # noqa: F401 - imported once here, shared by every child (export loads it)

    from paralayer.checkpoint import dcp, export  # noqa: F401
    from paralayer.data import prepare  # noqa: F401
    from paralayer.dispatch import slurm  # noqa: F401
    from paralayer.metrics import report  # noqa: F401
    from paralayer.model import transformer  # noqa: F401

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    results = []
    for case in cases(n, seed, kinds):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_case(case, tmp))
    by_kind: dict = {}
    for res in results:
        k = by_kind.setdefault(res["kind"], {"n": 0, "crash": 0, "time-out": 0, "unnamed": 0, "multi-line": 0,
                                             "secret": 0, "ansi": 0, "lost": 0, "max_wall": 0.0})
        k["n"] += 1
        k["max_wall"] = max(k["max_wall"], res["wall"])
        for p in res["problems"]:
            key = p.split(":")[0].split(" ")[0]
            key = "ansi" if key == "ANSI" else key
            k[key if key in k else "crash"] += 1
    cols = ["n", "crash", "time-out", "unnamed", "multi-line", "secret", "ansi", "lost", "max_wall"]
    print(f"{'kind':<16}" + "".join(f"{c:>11}" for c in cols))
    for kind, k in sorted(by_kind.items()):
        print(f"{kind:<16}" + "".join(f"{k[c]:>11.2f}" if c == "max_wall" else f"{k[c]:>11}" for c in cols))
    bad = [r for r in results if r["problems"]]
    print(f"total {len(results)} cases, {len(bad)} with problems")
    for res in bad[:show]:
        print(f"- {res['kind']}: {res['problems']} rc={res['rc']} argv={[a[:60] for a in res['argv']]} "
              f"err={res['err'][-200:]!r}")
    return 1 if bad else 0
