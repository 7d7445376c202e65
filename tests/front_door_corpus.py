"""A generated corpus of bad inputs for the front door (issue 28), run in-process one at a time.

    python tests/front_door_corpus.py [--n 3000] [--seed 0] [--kinds deep,swap,...] [--show 20]
    python tests/front_door_corpus.py --commands [--n 400]    every other command (tests/command_corpus.py)

Each case is argv for ``launch.py`` (``--dry-run`` or ``--plan``), sometimes with a recipe file or
an HF config.json written for it. Checked per case: the exit code is 0 or 2; the process CPU time
is under the bound (2 s); an exit 2 prints ``error:`` lines, each one line, the first naming a
field (or file); no ANSI escape and no planted secret reaches stdout or stderr. Prints counts per
kind and the worst cases; exits 1 if any case breaks the contract. ``cases(n, seed)`` is what
tests/test_front_door_bounds.py samples for its fast subset.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import sys
import tempfile
import time
from typing import Callable, Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from paralayer import cli  # noqa: E402
from tests.cpu_budget import machine_scale  # noqa: E402

SECRET = "sk_CORPUS_7f3a9c11e2"
BOUND_S = 2.0
#: what an exit-2 message must name, by kind (any one of them)
FIELDS = ("recipe", "model.", "parallel.", "train.", "data.", "cluster.", "checkpoint.", "run.", "logging.",
          "sweep", "--top", "memory:", "base")
RECIPES = ["tiny", "tiny-moe", "llama3-8b", "llama3-70b", "mixtral-8x7b"]
CONTAINER_FIELDS = ["parallel.pp_layout", "cluster.slurm.sbatch_extra", "cluster.slurm.srun_args",
                    "cluster.slurm.setup", "sweep", "model", "parallel", "cluster.slurm", "run.name", "train.lr",
                    "data.path", "model.moe"]
CONTROL = ["\n", "\r", "\x1b[31m", "\x1b]0;pwn\x07", "\t", "\x00", "\x7f", "\u2028", "\x85", "\x1b[2J"]


def _nest(depth: int, kind: str, leaf: str = "1") -> str:
    if kind == "map":
        return "{a: " * depth + leaf + "}" * depth
    if kind == "list":
        return "[" * depth + leaf + "]" * depth
    return "".join("{a: [" for _ in range(depth // 2)) + leaf + "]}" * (depth // 2)


def _block(path: list[str], depth: int) -> str:
    lines, ind = [], ""
    for p in path:
        lines.append(f"{ind}{p}:")
        ind += "  "
    for i in range(depth):
        lines.append(f"{ind}k{i}:")
        ind += " "
    lines.append(f"{ind}x: 1")
    return "\n".join(lines)


def names_field(line: str, argv: list[str], tmp: str) -> bool:
    """The first error line begins with a field of the schema (or one the user typed), a file, or
    a flag: ``error: parallel.tp: ...``, ``error: [label] parallel.tp: ...``, ``error: parallel.tp=3: ...``."""
    from paralayer.config import all_keys

    text = line[len("error:"):].strip()
    if text.startswith("["):
        text = text[text.find("] ") + 2:] if "] " in text else text
    token = text.split(": ", 1)[0].split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    typed = {a.split("=", 1)[0].lstrip("+") for a in argv if "=" in a}
    known = set(all_keys()) | {"recipe", "cluster", "base", "sweep", "--top", "memory", "cluster.name"}
    if text.split(": ", 1)[-1].startswith("unknown key"):
        return True  # it names the key as typed (a key of no schema field)
    return (token in known or token in typed or token.startswith(("sweep.", "cluster.slurm.sbatch_extra."))
            or (tmp and tmp in text.split(": ", 1)[0]) or token.endswith("..."))


#: CPU seconds after which a case is stopped (and counted slow)
GIVE_UP_S = 10.0


class _GaveUp(BaseException):
    pass


def _give_up(signum, frame):
    raise _GaveUp()


class Case:
    def __init__(self, kind: str, argv: list[str], files: dict | None = None):
        self.kind, self.argv, self.files = kind, argv, files or {}


def _file_case(kind: str, text: str, extra: list[str], plan: bool = False) -> Case:
    return Case(kind, ["recipe={recipe.yaml}", *extra, "--plan" if plan else "--dry-run"], {"recipe.yaml": text})


def gen_deep(r: random.Random) -> Case:
    depth = r.choice([33, 40, 100, 300, 600, 2000])
    where = r.choice(["sweep:\n  k", "parallel:\n  pp_layout", "cluster:\n  slurm:\n    sbatch_extra:\n      k",
                      "unknown_key", "model"])
    style = r.choice(["map", "list", "mix", "block"])
    if style == "block":
        text = "base: tiny\n" + _block(where.replace(":\n", " ").split()[:1], min(depth, 200)) + "\n"
    else:
        text = f"base: tiny\n{where}: {_nest(depth, style)}\n"
    return _file_case("deep-recipe", text, [], plan=r.random() < 0.2)


def gen_deep_override(r: random.Random) -> Case:
    depth = r.choice([33, 100, 500, 5000])
    key = r.choice(CONTAINER_FIELDS)
    return Case("deep-override", [f"recipe={r.choice(RECIPES)}", f"{key}={_nest(depth, r.choice(['map', 'list', 'mix']))}",
                                  r.choice(["--dry-run", "--plan"])])


def gen_hf(r: random.Random) -> Case:
    depth = r.choice([40, 200, 600, 3000])
    body = r.choice(['{"a":' * depth + "1" + "}" * depth, "[" * depth + "]" * depth,
                     '{"hidden_size": 64, "x": ' + "[" * depth + "]" * depth + "}", '{"hidden_size": ' + "1" * 5000 + "}",
                     '{"s": "' + "[" * 5000 + '"}'])
    return Case("hf-config", ["recipe=tiny", "model.init=hf:{hfdir}", "--dry-run"], {"hfdir/config.json": body})


def gen_exponential(r: random.Random) -> Case:
    n = r.choice([20, 30, 60])
    where = r.choice(["sweep", "cluster.slurm.sbatch_extra"])
    pre = where.replace(".", "\n  ").split("\n")
    head = "".join("  " * i + p.strip() + ":\n" for i, p in enumerate(pre))
    ind = "  " * len(pre)
    lines = [f"{ind}a0: xxxxxxxxxxxxxxxx"]
    for i in range(1, n):
        ref = "${" + f"{where}.a{i - 1}" + "}"
        lines.append(f'{ind}a{i}: "{ref * r.choice([2, 3])}"')
    extra = ["-m"] if where == "sweep" and r.random() < 0.5 else []
    return _file_case("exponential-refs", "base: tiny\n" + head + "\n".join(lines) + "\n", extra)


def gen_anchor(r: random.Random) -> Case:
    lines = ["base: tiny", "cluster:", "  slurm:", "    sbatch_extra:", "      a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, r.choice([6, 9, 12])):
        lines.append(f"      a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return _file_case("alias-bomb", "\n".join(lines) + "\n", [])


def gen_swap(r: random.Random) -> Case:
    field, good = r.choice([("parallel.pp_layout", "list"), ("cluster.slurm.sbatch_extra", "map"),
                            ("cluster.slurm.srun_args", "list"), ("cluster.slurm.setup", "list"), ("sweep", "map"),
                            ("model", "map"), ("model.moe", "map"), ("parallel.tp", "value"), ("run.name", "value"),
                            ("train", "map"), ("cluster.slurm", "map")])
    bad = r.choice(["{a: 1}", "{a: {b: [1]}}", "[1, 2]", "[[1]]", "[{a: 1}]", "5", "x"])
    parts = field.split(".")
    text = "base: tiny\n" + "".join("  " * i + p + ":\n" for i, p in enumerate(parts[:-1]))
    text += "  " * (len(parts) - 1) + f"{parts[-1]}: {bad}\n"
    if r.random() < 0.3:
        return Case("type-swap-override", ["recipe=tiny", f"{field}={bad}", "--dry-run"])
    return _file_case("type-swap", text, [], plan=r.random() < 0.1)


def gen_top(r: random.Random) -> Case:
    top = r.choice(["100000", "1000000", "10" + "0" * 20, "1001", "5000"])
    ov = r.choice([["recipe=llama3-405b", "cluster=h100-80gb-8x", "cluster.nodes=2048"],
                   ["recipe=llama3-70b", "cluster=h100-80gb-8x"], ["recipe=tiny"]])
    return Case("huge-top", [*ov, "--plan", "--top", top] + (["--json"] if r.random() < 0.4 else []))


def gen_sweep(r: random.Random) -> Case:
    kind = r.choice(["16x16", "names", "over"])
    if kind == "16x16":
        a = ",".join(str(i) for i in range(1, 17))
        keys = r.sample(["train.steps", "train.seed", "parallel.tp", "train.micro_batch", "train.lr",
                         "checkpoint.every", "parallel.pp"], 2)
        ov = [f"{keys[0]}={a}", f"{keys[1]}={a}"]
    elif kind == "names":
        ov = ["run.name=" + ",".join(f"r{i}" for i in range(r.choice([100, 200, 256])))]
    else:
        ov = ["train.seed=" + ",".join(str(i) for i in range(300))]
    rec = r.choice(["tiny", "llama3-70b", "llama3-8b"])
    return Case("sweep-bound", [f"recipe={rec}", *ov, "-m", "--dry-run"] + (["--json"] if r.random() < 0.3 else []))


def gen_no_fit(r: random.Random) -> Case:
    ov = r.choice([["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=13", "cluster.devices_per_node=7"],
                   ["recipe=llama3-70b", "cluster=h100-80gb-8x", "parallel.tp=3"],
                   ["recipe=llama3-405b", "cluster=h100-80gb-8x", "cluster.nodes=1"],
                   ["recipe=llama3-70b", "cluster=a100-80gb-8x", "parallel.tp=2"],
                   ["recipe=tiny", "parallel.pp=3"], ["recipe=mixtral-8x7b", "cluster=h100-80gb-8x", "parallel.ep=3"],
                   ["recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=3", "cluster.devices_per_node=5"]])
    return Case("no-fit", [*ov, "--plan"] + (["--json"] if r.random() < 0.3 else []))


def gen_control(r: random.Random) -> Case:
    c = r.choice(CONTROL)
    key = r.choice(["run.name", "parallel.schedule", "data.format", "model.init", "recipe", "cluster",
                    "train.lr", "parallel.tp", "logging.wandb.mode", "nokey.x", "model.dmodel"])
    value = r.choice([f"a{c}b", f"{c}", f"gpipe{c}", f"hf:/x{c}y", f"1{c}", f"[1,{c}2]", f"${{{c}}}"])
    argv = [f"{key}={value}", "--dry-run"] + (["--json"] if r.random() < 0.2 else [])
    if r.random() < 0.2:
        argv = [f"run.name=a{c}b,c{c}d", "-m", "--dry-run"]
    if r.random() < 0.15:
        return _file_case("control-in-file", f"base: tiny\nrun:\n  name: \"a{c.encode('unicode_escape').decode()}b\"\n"
                          f"parallel:\n  schedule: \"x{c.encode('unicode_escape').decode()}\"\n", [])
    return Case("control-chars", argv)


def gen_dotted(r: random.Random) -> Case:
    text = r.choice(["model: {moe.top_k: 1}", "parallel: {tp.x: 1}", "model.moe.top_k: 1", "cluster: {slurm.time_min: 5}",
                     "train: {lr.x: 1, steps: 2}", "model: {moe: {top_k.y: 1}}"])
    return _file_case("dotted-in-map", f"base: tiny\n{text}\n", [])


def gen_secret(r: random.Random) -> Case:
    spelled = r.choice(["${oc.env:WANDB_API_KEY}", "${oc.env:WANDB_API_KEY,d}", "x${oc.env:WANDB_API_KEY}",
                        "${oc.decode:${oc.env:WANDB_API_KEY}}"])
    if r.random() < 0.5:
        return Case("secret", [f"{r.choice(['run.name', 'sweep.k', 'cluster.slurm.sbatch_extra.x'])}={spelled}",
                               "--dry-run"])
    return _file_case("secret-file", f"base: tiny\nsweep:\n  run.name: ['{spelled}', b]\n", ["-m"])


def gen_markup(r: random.Random) -> Case:
    value = r.choice(["x[/red]y", "[bold]", "[/]", "[link=file:///etc/passwd]x[/link]", "\\[x]", "[red"])
    key = r.choice(["cluster.name", "run.name", "parallel.schedule", "run.dir", "data.path"])
    mode = r.choice([["--plan"], ["--dry-run"], ["--plan", "--top", "60"], ["--dry-run", "--json"]])
    return Case("markup", [f"{key}={value}", *mode])


GENERATORS: dict[str, Callable[[random.Random], Case]] = {
    "deep": gen_deep, "deep-override": gen_deep_override, "hf": gen_hf, "exponential": gen_exponential,
    "alias": gen_anchor, "swap": gen_swap, "top": gen_top, "sweep": gen_sweep, "no-fit": gen_no_fit,
    "control": gen_control, "dotted": gen_dotted, "secret": gen_secret, "markup": gen_markup,
}


def cases(n: int, seed: int = 0, kinds: list[str] | None = None, generators: dict | None = None) -> Iterator:
    """``n`` cases drawn in turn from each kind of ``generators`` (the front door's by default)."""
    gens = generators or GENERATORS
    r = random.Random(seed)
    names = kinds or list(gens)
    for i in range(n):
        yield gens[names[i % len(names)]](r)


def echo_problems(text: str, secret: str = SECRET) -> list[str]:
    """What no command may print: the planted secret, or a raw ANSI escape."""
    return (["secret echoed"] if secret in text else []) + (["ANSI escape passed through"] if "\x1b" in text else [])


def error_lines(err: str) -> tuple[list[str], list[str]]:
    """(the non-blank lines of stderr, those that are an ``error:`` line)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return lines, [ln for ln in lines if ln.startswith("error:")]


def run_case(case: Case, tmp: str) -> dict:
    """One case in-process: exit code, CPU seconds, stdout/stderr, and what is wrong with them."""
    subs = {}
    for rel, text in case.files.items():
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        subs["{" + rel.split("/")[0] + "}"] = os.path.join(tmp, rel.split("/")[0])
    argv = [a for a in case.argv]
    for k, v in subs.items():
        argv = [a.replace(k, v) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    t0 = time.process_time()
    old = signal.signal(signal.SIGPROF, _give_up)
    signal.setitimer(signal.ITIMER_PROF, GIVE_UP_S)  # CPU seconds: a hang ends as "slow", not as a stuck run
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code
        except _GaveUp:
            rc = 0
        except BaseException as exc:  # noqa: BLE001 - a crash is a finding
            rc = f"raised {type(exc).__name__}"
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, old)
    cpu = time.process_time() - t0
    o, e = out.getvalue(), err.getvalue()
    problems = []
    if rc not in (0, 2):
        problems.append(f"exit {rc}")
    if cpu > BOUND_S and cpu > BOUND_S * machine_scale():  # the bound on a slower or busier machine
        problems.append(f"slow {cpu:.2f} s")
    problems += echo_problems(o + e)
    if rc == 2:
        lines, errs = error_lines(e)
        if not errs:
            problems.append("exit 2 without an error: line")
        elif not names_field(errs[0], argv, tmp):
            problems.append("rejection names no field")
        if any(not (ln.startswith(("error:", "warning:", "note:", "usage:", "  ")) or ln[:1] == " ") for ln in lines):
            problems.append("a message spans lines")
    return {"kind": case.kind, "argv": argv, "rc": rc, "cpu": cpu, "err": e[-300:], "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=None)
    ap.add_argument("--show", type=int, default=15)
    ap.add_argument("--commands", action="store_true", help="the commands' corpus (tests/command_corpus.py): "
                    "prepare, report, export, resubmit, slurm")
    args = ap.parse_args(argv)
    if args.commands:
        import command_corpus

        return command_corpus.main(args.n, args.seed, args.kinds.split(",") if args.kinds else None, args.show)
    os.environ["WANDB_API_KEY"] = SECRET
    cli.main(["recipe=tiny", "--dry-run", "--json"])  # one-time imports do not count against the bound
    results = []
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["recipe=tiny", "--plan", "--json"])
    for case in cases(args.n, args.seed, args.kinds.split(",") if args.kinds else None):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_case(case, tmp))
    by_kind: dict = {}
    for res in results:
        k = by_kind.setdefault(res["kind"], {"n": 0, "bad_exit": 0, "slow": 0, "unnamed": 0, "multiline": 0,
                                             "secret": 0, "ansi": 0, "max_cpu": 0.0})
        k["n"] += 1
        k["max_cpu"] = max(k["max_cpu"], res["cpu"])
        for p in res["problems"]:
            key = {"exit": "bad_exit", "slow": "slow", "rejection": "unnamed", "a message": "multiline",
                   "secret": "secret", "ANSI": "ansi"}.get(p.split()[0], "unnamed")
            k[key] += 1
    cols = ["n", "bad_exit", "slow", "unnamed", "multiline", "secret", "ansi", "max_cpu"]
    print(f"{'kind':<20}" + "".join(f"{c:>10}" for c in cols))
    for kind, k in sorted(by_kind.items()):
        print(f"{kind:<20}" + "".join(f"{k[c]:>10.2f}" if c == "max_cpu" else f"{k[c]:>10}" for c in cols))
    total = {c: sum(k[c] for k in by_kind.values()) for c in cols if c != "max_cpu"}
    print("total " + ", ".join(f"{c} {v}" for c, v in total.items()))
    bad = [r for r in results if r["problems"]]
    for res in sorted(bad, key=lambda r: -r["cpu"])[:args.show]:
        print(f"- {res['kind']}: {res['problems']} rc={res['rc']} cpu={res['cpu']:.2f} argv={[a[:80] for a in res['argv']]}"
              f" err={res['err'][-200:]!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
