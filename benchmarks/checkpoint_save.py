"""Checkpoint save overhead: our save (DCP + per-rank digests + manifest + atomic rename +
retention) and our save followed by a full verification, against a bare DCP save of the same state.

    python benchmarks/checkpoint_save.py [--ranks 2] [--d-model 384] [--layers 6] [--repeats 7]

Each repeat saves the same model + AdamW state (FSDP2 over the ranks, fp32) three ways, in turn,
into fresh directories on the same file system: bare ``dcp.save(FileSystemWriter(sync_files=True))``,
``paralayer.checkpoint.dcp.save_checkpoint``, and the latter + ``verify_checkpoint(full=True)``
on every rank for the files it wrote. Prints medians and the ratios to the bare save (markdown).
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, world: int, store_path: str, args, root: str, q) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from paralayer.checkpoint.dcp import save_checkpoint
    from paralayer.checkpoint.manifest import verify_checkpoint
    from paralayer.checkpoint.state import get_states
    from paralayer.config import ModelConfig
    from paralayer.model.transformer import Transformer, init_weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                      ffn_hidden=int(args.d_model * 8 / 3) // 64 * 64, vocab_size=8192, seq_len=64)
    with torch.device("meta"):
        model = Transformer(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 8192, (1, 64))).float().mean().backward()
    opt.step()
    times: dict[str, list[float]] = {"bare": [], "ours": [], "ours+verify": []}
    for i in range(args.repeats):
        kinds = list(times)
        for kind in kinds[i % 3:] + kinds[:i % 3]:  # each first in turn: no order bias
            path = os.path.join(root, f"{kind.replace('+', '_')}-{i}")
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "bare":
                dcp.save(get_states([model], [opt]), storage_writer=dcp.FileSystemWriter(path, sync_files=True))
            else:
                final = save_checkpoint(path, i + 1, [model], [opt], {"step": i + 1})
                if kind == "ours+verify":
                    mine = [n for n in os.listdir(final)
                            if n.startswith(f"__{rank}_") or n == f"extra-rank{rank:05d}.pt"]
                    verify_checkpoint(final, full=True, names=mine + ([".metadata"] if rank == 0 else []))
            dist.barrier()
            times[kind].append(time.perf_counter() - t0)
            if rank == 0 and i == 0 and kind == "bare":
                q.put(("bytes", sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        q.put(("times", times))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    store = os.path.join(root, "store")
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, store, args, root, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in range(2))
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)
    times, size = got["times"], got["bytes"]
    bare = statistics.median(times["bare"])
    print(f"state: {size / 1e6:.1f} MB over {args.ranks} ranks (d_model {args.d_model}, {args.layers} layers, "
          f"model + AdamW, fp32), {args.repeats} repeats, medians\n")
    print("| save | median s | ratio to bare DCP save |")
    print("|---|---:|---:|")
    for kind, ts in times.items():
        m = statistics.median(ts)
        print(f"| {kind} | {m:.3f} | {m / bare:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
