"""Export a run's checkpoint to the Hugging Face format (config.json + model.safetensors).

    python -m paralayer.checkpoint.export RUN_DIR --out DIR [--checkpoint PATH]

The checkpoint may come from any layout: it is loaded into one process (torch.distributed.checkpoint
reshards by parameter name) and written whole, in the layout transformers' from_pretrained reads.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile


def export_run(run_dir: str, out_dir: str, checkpoint: str | None = None) -> str:
    import torch
    import torch.distributed as dist

    from paralayer import config as config_mod
    from paralayer.checkpoint import dcp as ckpt
    from paralayer.checkpoint.hf import export_hf
    from paralayer.model.transformer import Transformer

    cfg = config_mod.from_yaml_file(os.path.join(run_dir, "resolved.yaml"))
    path = checkpoint
    if path is None:
        root = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
        path = ckpt.find_latest(root)
        if path is None:
            raise SystemExit(f"paralayer: no complete checkpoint under {root}")
    own_group = not dist.is_initialized()
    if own_group:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        model = Transformer(cfg.model)
        ckpt.load_checkpoint(path, [model], [])
        export_hf([model], cfg.model, out_dir)
    finally:
        if own_group:
            dist.destroy_process_group()
    del torch
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paralayer.checkpoint.export", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the newest complete one)")
    args = ap.parse_args(argv)
    out = export_run(args.run_dir, args.out, args.checkpoint)
    print(f"paralayer: exported {args.run_dir} to {out} (Hugging Face format)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
