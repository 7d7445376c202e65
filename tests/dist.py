"""Run a function on N real gloo ranks (forked processes) and collect what each returns.

Fork keeps the parent's already-imported torch, so a 4-rank test starts in well under a second
instead of ~5 s of imports per rank. Every rank gets a process group with a short timeout, so an
unmatched collective fails the test instead of hanging CI.

``PARALAYER_TEST_BACKEND=nccl`` (a multi-GPU box) runs the same tests on NCCL: one GPU per rank
(rank % visible GPUs), ranks started with spawn (a forked child cannot use CUDA), and
:func:`cfg_and_plan` puts the run on ``cluster.device=cuda``, so the parity suite's train() runs
on the GPUs. Tests whose workers build CPU tensors by hand stay gloo-only.
"""
from __future__ import annotations

import datetime
import functools
import gc
import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable, Optional

from paralayer.rehearse.fork_server import PRELOAD

DEFAULT_TIMEOUT_S = 120
BACKENDS = ("gloo", "nccl")


def backend() -> str:
    """The process-group backend the tests use: PARALAYER_TEST_BACKEND (gloo unless set)."""
    b = os.environ.get("PARALAYER_TEST_BACKEND", "gloo")
    if b not in BACKENDS:
        raise ValueError(f"PARALAYER_TEST_BACKEND={b!r}; valid: {', '.join(BACKENDS)}")
    return b


def _child(fn, rank, world_size, store_path, args, queue, pg_timeout_s, kind="gloo"):
    # a forked rank inherits the test worker's heap (hundreds of tests' objects): out of the
    # collector's view, or a full collection walks it inside a step (0.2 s and more on a loaded
    # machine: the straggler tests read it as the healthy rank being slow)
    gc.freeze()
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        if kind == "nccl":
            os.environ["LOCAL_RANK"] = str(rank)  # train.resolve_device picks this GPU
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            kind, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


#: imported once in the test process before a world forks, so that no rank imports them again: the
#: launcher's fork-server preload (the runtime, the rehearsal's counters and what train() imports
#: lazily: DTensor's and FSDP's paths pull torch._dynamo, the pipeline torch.distributed.pipelining),
#: less the server's own exit hook, and what the tests' worlds reach beside it: ~1 CPU-s in each rank
#: of each world otherwise (7 Dec: a 4-rank tp2·dp2 world spent 1.68 CPU-s per rank in its first
#: train(), 1.1 s of it importing 329 modules)
WARM = tuple(m for m in PRELOAD if m != "paralayer.rehearse.server_exit") + (
    "torch.distributed.tensor.parallel", "paralayer.parallel.pipeline", "paralayer.parallel.expert",
    "paralayer.metrics.goodput", "paralayer.metrics.profile", "paralayer.metrics.rank_timing",
    "paralayer.metrics.throughput", "paralayer.metrics.waited_for", "paralayer.metrics.peaks", "numpy.random",
    "cProfile", "pstats")


@functools.lru_cache(maxsize=None)
def warm() -> None:
    """Import :data:`WARM` in this process (once): forked ranks inherit them."""
    import importlib

    for name in WARM:
        importlib.import_module(name)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S, pg_timeout_s: float = 60,
              backend_name: Optional[str] = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function; its return value must be picklable (use
    ``.tolist()`` or ``.item()`` for tensors). Raises AssertionError naming the failing rank.
    """
    kind = backend_name or backend()
    if kind != "nccl":
        warm()
    ctx = mp.get_context("spawn" if kind == "nccl" else "fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store_path, args, queue, pg_timeout_s, kind))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while len(results) + len(errors) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise AssertionError(f"ranks timed out after {timeout_s}s; finished: {sorted(results)}")
                try:
                    rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                except Exception:  # noqa: B904 - queue.Empty: poll the children
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and not any(i in results or i in errors for i in dead):
                        raise AssertionError(f"rank(s) {dead} died with exit codes "  # noqa: B904
                                             f"{[procs[i].exitcode for i in dead]}")
                    continue
                (results if status == "ok" else errors)[rank] = payload
                if errors:
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        return [results[r] for r in range(world_size)]


def worlds_by_size(jobs: dict, world_of: Callable[[Any], int], fn: Callable[..., Any],
                   timeout_s: float = 600) -> Callable[[Any], Any]:
    """``get(key)``: rank 0's result for ``jobs[key]``. The jobs of one world size run in turn in ONE
    forked world (``fn(rank, world, [job, ...])`` returns one result per job), started the first time a
    test asks for one of them: a world per size, not per case."""
    cache: dict = {}

    def get(key: Any) -> Any:
        if key not in cache:
            world = world_of(jobs[key])
            group = [k for k in jobs if world_of(jobs[k]) == world]
            out = run_ranks(fn, world, [jobs[k] for k in group], timeout_s=timeout_s, pg_timeout_s=60)[0]
            cache.update(zip(group, out))
        return cache[key]

    return get

def cfg_and_plan(overrides: list[str]):
    """A config from ``recipe=... key=value`` overrides and its plan dict; the plan must be valid."""
    from paralayer.config import load_config
    from paralayer.resolve.plan import resolve

    if backend() == "nccl":
        overrides = list(overrides) + ["cluster.device=cuda"]
    cfg = load_config(list(overrides))
    plan = resolve(cfg).to_dict()
    assert not plan["errors"], plan["errors"]
    return cfg, plan


#: the tiny recipe cut down for parity runs: plain data parallel (tp=1), 2 layers, seq 64, 5 steps, at a
#: wide init (std 0.2: at 0.02 every model's loss is ~ln(vocab), and a wrong layout can match it)
TINY_SMALL = ["recipe=tiny", "parallel.tp=1", "train.steps=5", "train.global_batch=8", "train.micro_batch=2",
              "model.n_layers=2", "model.seq_len=64", "model.init_std=0.2", "logging.wandb.mode=disabled"]


def paired(got, want) -> zip:
    """``zip`` for parity checks, which fails on empty or mismatched records (a bare zip of an
    empty result passes without checking anything)."""
    got, want = list(got), list(want)
    assert len(got) == len(want) > 0, f"records: got {len(got)}, reference {len(want)}"
    return zip(got, want)


def plant_halved_expert_grads() -> None:
    """A planted bug for the MoE parity tests, in this rank: under ep > 1 every expert gradient is
    halved after the reduction (a divisor counted twice), which losses alone do not show."""
    from paralayer.runtime import train as T

    real = T.finish_grads

    def halved(scaling, reducer, expert_params, *a, **k):
        real(scaling, reducer, expert_params, *a, **k)
        if scaling.ep > 1:
            for p in expert_params:
                if p.grad is not None:
                    p.grad.mul_(0.5)

    T.finish_grads = halved


def max_rel_err(got, want) -> float:
    """The largest |got − want| / |want| over paired records (fails on empty or mismatched ones)."""
    return max(abs(a - b) / abs(b) for a, b in paired(got, want))


def train_records(overrides: list[str]) -> list[dict]:
    """One rank's ``train()`` on the config and plan of ``overrides``: its metrics records."""
    from paralayer.runtime.train import train

    cfg, plan = cfg_and_plan(overrides)
    return train(cfg, plan)


def write_tokens(path: str, lines: int, seq: int, vocab: int, keep_existing: bool = False) -> str:
    """A ``data.format=tokens`` file of ``lines`` random sequences (seed 0, the same ids for the
    same arguments); ``keep_existing``: leave a file already there as it is."""
    import json

    import torch

    if keep_existing and os.path.exists(path):
        return path
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(lines):
            f.write(json.dumps({"input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist()}) + "\n")
    return path
