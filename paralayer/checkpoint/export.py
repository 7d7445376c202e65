"""Export a run's checkpoint to the Hugging Face format (config.json + model.safetensors).

    python -m paralayer.checkpoint.export RUN_DIR --out DIR [--checkpoint PATH]

The checkpoint may come from any layout: it is loaded into one process (torch.distributed.checkpoint
reshards by parameter name) and written whole, in the layout transformers' from_pretrained reads.

Without ``--checkpoint`` export picks as ``train.resume=auto`` does: the newest checkpoint that
loads and verifies, falling back past each damaged or mismatched one and naming it (on stderr).
Unlike resume it moves nothing: the run folder is input, read only. The files are written under
temporary names and renamed into ``--out`` when whole. The run folder, its resolved.yaml and its
checkpoints are untrusted input (paralayer/inputs/untrusted.py): bad input is exit 2, one line.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import sys
import tempfile

from paralayer.inputs.echo import one_line
from paralayer.inputs.untrusted import (
    ArgParser,
    BadInput,
    check_dir,
    check_file,
    check_out,
    guard,
    refuse_overwrite,
    show,
)


def _candidates(root: str) -> list[str]:
    from paralayer.checkpoint.retention import list_checkpoints

    return list(reversed(list_checkpoints(root))) if os.path.isdir(root) else []


def _load(paths: list[str], model, field: str) -> str:
    """Load the first of ``paths`` (newest first) that loads and verifies into ``model``; each one
    skipped is named on stderr. BadInput naming ``field`` and every reason when none loads."""
    from paralayer.checkpoint import dcp as ckpt
    from paralayer.checkpoint.manifest import CheckpointError

    failed = []
    for path in paths:
        try:
            ckpt.load_checkpoint(path, [model], [])
            return path
        except CheckpointError as exc:
            failed.append(f"{os.path.basename(path)}: {one_line(exc, 300)}")
            if len(paths) > 1:
                print(f"warning: export: skipping checkpoint {show(path)}: {one_line(exc, 300)}", file=sys.stderr)
    raise BadInput(field, "no checkpoint loads: " + "; ".join(failed))


def export_run(run_dir: str, out_dir: str, checkpoint: str | None = None) -> str:
    import torch.distributed as dist

    from paralayer import config as config_mod
    from paralayer.checkpoint.hf import export_hf
    from paralayer.model.transformer import Transformer

    check_dir(run_dir, "RUN_DIR")
    resolved = os.path.join(run_dir, "resolved.yaml")
    check_file(resolved, "RUN_DIR", 1 << 20)
    out = check_out(out_dir, "--out")
    cfg = config_mod.from_yaml_file(resolved)
    root = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    if checkpoint is not None:
        check_dir(checkpoint, "--checkpoint")
        paths, field = [checkpoint], "--checkpoint"
    else:
        paths, field = _candidates(root), "checkpoint.dir"
        if not paths:
            raise BadInput(field, f"{show(root)}: no complete checkpoint (of run {show(run_dir)})")
    refuse_overwrite([out], [resolved, root] + paths, "--out")
    own_group = not dist.is_initialized()
    if own_group:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    tmp = None
    try:
        model = Transformer(cfg.model)
        _load(paths, model, field)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
        export_hf([model], cfg.model, tmp)
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(tmp), key=lambda n: n.endswith(".json")):  # config.json last
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if own_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return out_dir


def _main(argv: list[str] | None) -> int:
    ap = ArgParser(prog="python -m paralayer.checkpoint.export", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the newest that verifies)")
    args = ap.parse_args(argv)
    out = export_run(args.run_dir, args.out, args.checkpoint)
    print(f"paralayer: exported {show(args.run_dir)} to {show(out)} (Hugging Face format)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 exported; 2 bad input (one line naming RUN_DIR, --out, --checkpoint or checkpoint.dir)."""
    return guard("export", lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
