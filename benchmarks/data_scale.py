"""Data at scale (issue #27): start-up and memory independent of the corpus, loader throughput,
prepare throughput. Writes the "Data at scale" section of docs/BENCHMARKS.md.

    python benchmarks/data_scale.py [--dir /tmp/paralayer-data-bench] [--repeats 3] [--out docs/BENCHMARKS.md]

1. A synthetic indexed corpus of >= 2^31 ids (4 GiB of uint16, three shards written directly, no
   tokenizer) against a 10 MB one, under the same recipe (recipe=tiny, data.format=indexed):
   seconds from launch to the first step's metrics line, and each rank's peak RSS (VmHWM, polled
   from /proc every 50 ms over the launcher's process tree). Medians over the repeats, interleaved.
2. Loader tokens/s alone (build_dataset + get_batch, shuffled, the tiny recipe's batch), as a ratio
   of the tokens/s the tiny recipe trains at (median of the same runs), for the 4 GiB corpus as one
   source (the directory) and as a blend of its three shards.
3. prepare (datasets map, num_proc = cores) against a bare tokenizers ``encode_batch`` over the
   same lines on the same cores, with a BPE tokenizer trained on the text.
The corpus is deleted afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
from doc_sections import write_named_section  # noqa: E402 - the same section writer as the planner examples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DOC = 4096  # ids per synthetic document
RECIPE = ["recipe=tiny", "train.steps=3", "logging.wandb.mode=disabled", "logging.progress=false",
          "data.format=indexed", "data.shuffle=true"]


def write_synthetic(prefix: str, n_tokens: int, seed: int) -> None:
    """A shard of n_tokens random byte ids (uint16), documents of DOC ids, written directly."""
    from paralayer.data.indexed import write_index

    g = np.random.default_rng(seed)
    chunk = 1 << 26
    with open(prefix + ".bin", "wb") as f:
        left = n_tokens
        while left:
            k = min(chunk, left)
            f.write(g.integers(0, 256, size=k, dtype=np.uint16).tobytes())
            left -= k
    n_docs, tail = divmod(n_tokens, DOC)
    lengths = np.full(n_docs + (1 if tail else 0), DOC, dtype=np.int32)
    if tail:
        lengths[-1] = tail
    write_index(prefix + ".idx", 8, lengths)


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _hwm(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def launch_once(path: str, run_dir: str) -> dict:
    """One run of the recipe: seconds to the first metrics line, peak RSS of each rank, tokens/s."""
    shutil.rmtree(run_dir, ignore_errors=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "launch.py"), *RECIPE, f"data.path={path}",
                             f"run.dir={run_dir}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": REPO})
    first, peaks = None, {}
    while proc.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            first = time.perf_counter() - t0
        for p in _tree(proc.pid)[1:]:
            h = _hwm(p)
            if h:
                peaks[p] = max(peaks.get(p, 0), h)
        time.sleep(0.05)
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {err[-2000:]}")
    recs = [json.loads(x) for x in open(metrics)]
    ranks = sorted(peaks.values(), reverse=True)[:4]  # the 4 ranks are the largest processes of the tree
    return {"first_step_s": first, "rss": ranks, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs)}


def loader_rate(data_cfg, seconds: float = 10.0) -> float:
    """Tokens/s that build_dataset + get_batch deliver alone (one process, the tiny recipe's batch)."""
    from paralayer.data.dataset import build_dataset

    ds = build_dataset(data_cfg, 128, 0, "/tmp/paralayer-bench-cache", global_batch=16, vocab_size=256)
    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:  # consecutive steps; the shuffle reads all over the corpus
        step += 1
        ds.get_batch(step)
    return step * 16 * 128 / (time.perf_counter() - t0)


def open_times(d: str, repeats: int = 7) -> dict:
    """Median ms to open each corpus and read its first batch, and to resolve its plan (headers)."""
    from paralayer.config import DataConfig, load_config
    from paralayer.data.dataset import build_dataset
    from paralayer.resolve.plan import resolve

    out: dict = {"open": {}, "resolve": {}}
    for _ in range(repeats):
        for name in ("small", "big"):
            p = os.path.join(d, name)
            t0 = time.perf_counter()
            build_dataset(DataConfig(path=p, format="indexed"), 128, 0, "/tmp/paralayer-bench-cache", global_batch=16,
                          vocab_size=256).get_batch(1, 0, 2)
            t1 = time.perf_counter()
            resolve(load_config(["recipe=tiny", "data.format=indexed", f"data.path={p}"]))
            out["open"].setdefault(name, []).append(1e3 * (t1 - t0))
            out["resolve"].setdefault(name, []).append(1e3 * (time.perf_counter() - t1))
    return {k: {n: statistics.median(v) for n, v in m.items()} for k, m in out.items()}


def prepare_vs_bare(d: str, repeats: int) -> dict:
    """prepare's tokens/s against a bare encode_batch over the same lines (BPE, 8k vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from paralayer.data.corpus import make_corpus
    from paralayer.data.prepare import prepare_files
    from paralayer.data.tokenizers import load_tokenizer

    text = make_corpus(os.path.join(d, "text.txt"), n_bytes=30_000_000, seed=1)
    lines = open(text, encoding="utf-8").read().splitlines()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(lines[:20000], trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tpath = os.path.join(d, "bpe.json")
    tok.save(tpath)
    workers = os.cpu_count() or 1
    import datasets  # noqa: F401 - imported before the clock starts, as tokenizers is for the bare run

    bare, prep = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(lines), 1000):
            n += sum(len(e.ids) for e in tok.encode_batch(lines[i:i + 1000], add_special_tokens=False))
        bare.append(n / (time.perf_counter() - t0))
        st = prepare_files([text], os.path.join(d, "prep"), "text", "text", load_tokenizer(tpath), workers)
        prep.append((st["tokens"] - st["documents"]) / st["seconds"])  # the same ids, without the EOS
    return {"bare": statistics.median(bare), "prepare": statistics.median(prep), "workers": workers,
            "mb": os.path.getsize(text) / 1e6, "lines": len(lines)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/paralayer-data-bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="rewrite the 'Data at scale' section of this markdown file")
    ap.add_argument("--big-tokens", type=int, default=2 ** 31)
    args = ap.parse_args(argv)
    d = args.dir
    os.makedirs(os.path.join(d, "big"), exist_ok=True)
    os.makedirs(os.path.join(d, "small"), exist_ok=True)
    try:
        t0 = time.perf_counter()
        split = [args.big_tokens // 2, args.big_tokens * 3 // 10]
        split.append(args.big_tokens - sum(split))
        for i, n in enumerate(split):
            write_synthetic(os.path.join(d, "big", f"part{i}"), n, i)
        write_synthetic(os.path.join(d, "small", "part0"), 5_000_000, 9)
        gen_s = time.perf_counter() - t0
        big_bytes = sum(os.path.getsize(os.path.join(d, "big", n)) for n in os.listdir(os.path.join(d, "big")))
        runs = {"small": [], "big": []}
        for _ in range(args.repeats):
            for name in ("small", "big"):
                runs[name].append(launch_once(os.path.join(d, name), os.path.join(d, "run-" + name)))
                print(name, runs[name][-1], flush=True)
        from paralayer.config import DataConfig

        big_dir = os.path.join(d, "big")
        blend = [{"path": os.path.join(big_dir, f"part{i}"), "weight": w} for i, w in enumerate([0.5, 0.3, 0.2])]
        loader = {"one source": statistics.median(loader_rate(DataConfig(path=big_dir, format="indexed"))
                                                  for _ in range(args.repeats)),
                  "blend of 3": statistics.median(loader_rate(DataConfig(format="indexed", blend=blend))
                                                  for _ in range(args.repeats))}
        opened = open_times(d)
        prep = prepare_vs_bare(d, args.repeats)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree("/tmp/paralayer-bench-cache", ignore_errors=True)
    md = report(runs, loader, prep, big_bytes, args, gen_s, opened)
    print(md)
    if args.out:
        write_named_section(args.out, "## Data at scale", md)
    return 0


def report(runs: dict, loader: dict, prep: dict, big_bytes: int, args, gen_s: float, opened: dict) -> str:
    med = {n: statistics.median(r["first_step_s"] for r in rs) for n, rs in runs.items()}
    rss = {n: [statistics.median(r["rss"][k] for r in rs) for k in range(min(len(r["rss"]) for r in rs))]
           for n, rs in runs.items()}
    train_rate = statistics.median(r["tokens_per_s"] for rs in runs.values() for r in rs)
    load = os.getloadavg()[0]
    lines = [
        "## Data at scale: start-up, memory and throughput against corpus size (issue #27)",
        "",
        f"Command: `python benchmarks/data_scale.py --repeats {args.repeats} --out docs/BENCHMARKS.md` "
        f"(medians of {args.repeats} interleaved runs). The machine: {os.cpu_count()} CPU cores shared with other "
        f"jobs (load average {load:.1f} at the end): absolute seconds are noisy, the ratios are the figures.",
        "",
        f"Corpora: {args.big_tokens:,} ids ({big_bytes / 2**30:.2f} GiB of uint16 in 3 shards, written directly in "
        f"{gen_s:.0f} s, documents of {DOC} ids) against 5,000,000 ids (10 MB). Recipe: "
        f"`{' '.join(RECIPE)} data.path=DIR` (4 ranks: dp 2 × tp 2).",
        "",
        "| | 10 MB | 4 GiB | ratio |",
        "|---|---|---|---|",
        f"| launch → first step (s) | {med['small']:.2f} | {med['big']:.2f} | {med['big'] / med['small']:.3f} |",
    ]
    for k in range(min(len(rss["small"]), len(rss["big"]))):
        lines.append(f"| rank peak RSS #{k + 1} (MiB) | {rss['small'][k] / 2**20:.0f} | {rss['big'][k] / 2**20:.0f} | "
                     f"{rss['big'][k] / rss['small'][k]:.3f} |")
    o, r = opened["open"], opened["resolve"]
    lines += [
        f"| open + first batch, one process (ms) | {o['small']:.2f} | {o['big']:.2f} | {o['big'] / o['small']:.3f} |",
        f"| resolve with the data section (ms) | {r['small']:.0f} | {r['big']:.0f} | {r['big'] / r['small']:.3f} |",
    ]
    lines += [
        "",
        f"Loader alone (one process, shuffled, batches of 16 × 128 drawn all over the corpus): "
        f"{loader['one source']:,.0f} tokens/s from the 4 GiB corpus as one source, "
        f"{loader['blend of 3']:,.0f} tokens/s through a blend of its 3 shards (weights 0.5/0.3/0.2); the tiny "
        f"recipe trains at {train_rate:,.0f} tokens/s (median of the runs above): the loader delivers "
        f"{loader['one source'] / train_rate:,.0f}× and {loader['blend of 3'] / train_rate:,.0f}× what it consumes.",
        "",
        f"Prepare: {prep['mb']:.0f} MB of text ({prep['lines']:,} lines), a BPE tokenizer of 8,192 ids, "
        f"{prep['workers']} workers: `prepare` {prep['prepare']:,.0f} tokens/s against a bare tokenizers "
        f"`encode_batch` over the same lines on the same cores {prep['bare']:,.0f} tokens/s: "
        f"**{prep['prepare'] / prep['bare']:.2f}×** (prepare includes reading through `datasets`, the map, and "
        "writing and joining the shards).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
