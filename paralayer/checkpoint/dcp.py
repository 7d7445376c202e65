"""Checkpoints: torch.distributed.checkpoint (DCP) for model + optimizer, atomic and verifiable.

Layout of ``checkpoint.dir``::

    step-00000010/            a COMPLETE checkpoint (only complete ones carry this name)
        .metadata             DCP metadata (global shapes, which file holds which chunk)
        __0_0.distcp ...      DCP shards, one file per writing rank
        extra-rank00000.pt    per-rank small state (LR scheduler, RNG, step, data position),
                              written with torch.save, read back with weights_only=True
        COMPLETE              JSON manifest: step, world size, {file: {size, sha256}}
    step-00000020.tmp/        a save in progress, or one killed mid-way: ignored, cleaned later

A save writes everything into ``step-XXXXXXXX.tmp``; after a barrier rank 0 hashes the files,
writes ``COMPLETE`` (fsynced) and renames the directory to ``step-XXXXXXXX`` (``os.replace``:
atomic on POSIX). A kill at any moment leaves either the previous checkpoints untouched plus a
``.tmp`` directory, or the new complete one.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``: keys are the
parameters' fully qualified names (FQNs) and the optimizer state is flattened by FQN
(``flatten_optimizer_state_dict=True``), so a checkpoint saved under one layout (tp, pp, dp, zero,
ep) loads under another: DCP reshards DTensors, and a pipeline stage only asks for its own keys.
Experts under expert parallel are plain local slices (not DTensors); they are saved under
per-expert keys (``...feed_forward.w1`` → ``...feed_forward.w1.expert{j}``), so the ep degree
may change too.

Trust boundary: see docs/checkpoints.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.checkpoint.expert_keys import clean_name, expert_owners, expert_templates, merge_expert_keys, split_expert_keys

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d{8})$")
_TMP_RE = re.compile(r"^step-(\d{8})\.tmp$")
_FORMAT = 1



class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and the bad file."""


# ---------------------------------------------------------------- small helpers
def step_dir(ckpt_root: str, step: int) -> str:
    return os.path.join(ckpt_root, f"step-{step:08d}")


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _broadcast_obj(obj: Any, group=None) -> Any:
    """rank 0 of ``group`` → everyone (the identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _data_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f != COMPLETE and os.path.isfile(os.path.join(path, f)))


# ---------------------------------------------------------------- RNG state (weights_only-safe)
def rng_state() -> dict:
    """Python, torch (CPU and CUDA) and numpy RNG states as plain types + tensors."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                          float(cached))
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict) -> None:
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


# ---------------------------------------------------------------- state dicts (FQN keyed)
def _options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=full)


def _inner(opt) -> torch.optim.Optimizer:
    """The torch optimizer behind a wrapper (the ZeRO-1 wrapper keeps it as ``.inner``)."""
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "inner"):
        opt = opt.inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"not an optimizer: {type(opt).__name__} (expected torch.optim.Optimizer or a "
                        f"wrapper with .inner)")
    return opt


def _param_fqns(parts: Sequence[nn.Module]) -> dict[int, str]:
    fqns: dict[int, str] = {}
    for part in parts:
        for name, p in part.named_parameters():
            fqns.setdefault(id(p), clean_name(name))
    return fqns


def _init_optim_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer state (a zero-lr step on zero grads) so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state as init

    init(opt)


_GROUP_SKIP = ("params",)


def _optim_state(parts: Sequence[nn.Module], optimizers: Sequence) -> dict:
    """Optimizer state flattened by parameter FQN (the DSD ``flatten_optimizer_state_dict`` form):
    ``state.{fqn}.{name}`` → tensor (a DTensor for a DTensor parameter), ``param_groups.{fqn}.{key}``
    → hyperparameter, plus ``param_groups.#{i}.{key}`` per group index. Any number of optimizers
    over any number of parts; a parameter this rank's optimizer does not hold (ZeRO-1) is absent."""
    fqns = _param_fqns(parts)
    out: dict = {}
    for opt in optimizers:
        opt = _inner(opt)
        _init_optim_state(opt)
        for gi, group in enumerate(opt.param_groups):
            hyper = {k: v for k, v in group.items() if k not in _GROUP_SKIP}
            for k, v in hyper.items():
                out[f"param_groups.#{gi}.{k}"] = v
            for p in group["params"]:
                fqn = fqns.get(id(p))
                if fqn is None:  # e.g. a placeholder parameter of an empty ZeRO-1 shard
                    continue
                for k, v in hyper.items():
                    out[f"param_groups.{fqn}.{k}"] = v
                for k, v in opt.state.get(p, {}).items():
                    out[f"state.{fqn}.{k}"] = v
    return out


def _set_optim_hyper(parts: Sequence[nn.Module], optimizers: Sequence, loaded: dict) -> None:
    fqns = _param_fqns(parts)
    for opt in optimizers:
        opt = _inner(opt)
        for gi, group in enumerate(opt.param_groups):
            src = None
            for p in group["params"]:
                fqn = fqns.get(id(p))
                if fqn is not None:
                    src = f"param_groups.{fqn}."
                    break
            if src is None:
                src = f"param_groups.#{gi}."
            for k in list(group.keys()):
                if k in _GROUP_SKIP:
                    continue
                if src + k in loaded:
                    group[k] = loaded[src + k]
                elif f"param_groups.#{gi}.{k}" in loaded:
                    group[k] = loaded[f"param_groups.#{gi}.{k}"]


def _raw_states(parts, opts) -> tuple[dict, dict, dict]:
    """(model sd, flattened optimizer sd, expert owners) merged over the parts, FQN keyed,
    experts still as local slices. Initialises empty optimizer state (a zero-lr step)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_sd: dict = {}
    owners: dict = {}
    for part in parts:
        owners.update(expert_owners(part))
        model_sd.update(get_model_state_dict(part, options=_options()))
    optim_sd = _optim_state(parts, opts) if opts else {}
    return model_sd, optim_sd, owners


def get_states(model_parts: Sequence[nn.Module], optimizers: Sequence) -> dict:
    """{"model": {fqn: tensor}, "optim": {flattened fqn keys}} merged over the model parts, with
    expert slices split into per-expert keys: what a checkpoint holds."""
    parts, opts = list(model_parts), list(optimizers or [])
    model_sd, optim_sd, owners = _raw_states(parts, opts)
    out = {"model": split_expert_keys(model_sd, owners)}
    if opts:
        out["optim"] = split_expert_keys(optim_sd, owners)
    return out


# ---------------------------------------------------------------- save
def save_checkpoint(ckpt_root: str, step: int, model_parts: Sequence[nn.Module],
                    optimizers: Sequence, extra: Optional[dict] = None,
                    group=None, keep: Optional[int] = None) -> str:
    """Save model + optimizer (DCP) and ``extra`` (this rank's small state) as ``step-XXXXXXXX``.

    Collective over ``group`` (default: the world): every rank calls it at the same step.
    ``extra``: plain types and tensors only (it is read back with ``weights_only=True``), e.g.
    ``{"step": k, "scheduler": sched.state_dict(), "rng": rng_state(), "data": {"step": k}}``.
    ``keep``: keep only that many newest complete checkpoints (None = keep all).
    Returns the final directory.
    """
    import torch.distributed.checkpoint as dcp

    rank, world = _rank(group), _world(group)
    final = step_dir(ckpt_root, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(ckpt_root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(group)

    states = get_states(model_parts, optimizers)
    use_dist = dist.is_available() and dist.is_initialized()
    dcp.save(states, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
             process_group=group, no_dist=not use_dist)
    extra = dict(extra or {})
    extra.setdefault("step", step)
    extra_path = os.path.join(tmp, f"extra-rank{rank:05d}.pt")
    with open(extra_path, "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())
    _barrier(group)

    if rank == 0:
        files = {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": _sha256(os.path.join(tmp, name))}
                 for name in _data_files(tmp)}
        manifest = {"format": _FORMAT, "step": step, "world_size": world, "files": files}
        marker = os.path.join(tmp, COMPLETE)
        with open(marker, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):  # re-saving a step (e.g. after resuming from an older one)
            old = f"{final}.old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        _cleanup(ckpt_root, keep, current=step)
    _barrier(group)
    return final


def _cleanup(ckpt_root: str, keep: Optional[int], current: int) -> None:
    """Remove stale .tmp / .old directories (killed saves) and all but the ``keep`` newest."""
    for name in os.listdir(ckpt_root):
        p = os.path.join(ckpt_root, name)
        if (_TMP_RE.match(name) or ".old-" in name) and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
    if keep is None or keep <= 0:
        return
    steps = sorted(_complete_steps(ckpt_root), reverse=True)
    for s in steps[keep:]:
        shutil.rmtree(step_dir(ckpt_root, s), ignore_errors=True)


def _complete_steps(ckpt_root: str) -> list[int]:
    if not os.path.isdir(ckpt_root):
        return []
    out = []
    for name in os.listdir(ckpt_root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(ckpt_root, name, COMPLETE)):
            out.append(int(m.group(1)))
    return sorted(out)


# ---------------------------------------------------------------- verify / find
def verify_checkpoint(path: str, full: bool = True) -> dict:
    """Check ``path`` against its manifest; returns the manifest or raises CheckpointError
    naming the offending file. ``full=False`` checks presence and sizes only (cheap)."""
    marker = os.path.join(path, COMPLETE)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: not a directory")
    if not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path}: no {COMPLETE} marker ({marker}): the save did not finish")
    try:
        with open(marker) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: corrupt manifest {marker}: {exc}") from None
    if ".metadata" not in files:
        raise CheckpointError(f"checkpoint {path}: manifest {marker} lists no .metadata file")
    for name, info in sorted(files.items()):
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint {path}: missing file {fp}")
        size = os.path.getsize(fp)
        if size != info["size"]:
            raise CheckpointError(f"checkpoint {path}: file {fp} has {size} bytes, the manifest says "
                                  f"{info['size']} (truncated or overwritten)")
        if full and info.get("sha256") and _sha256(fp) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {fp} does not match its sha256 checksum (corrupt)")
    return manifest


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Directories named like complete checkpoints (not verified), oldest first."""
    return [step_dir(ckpt_root, s) for s in _complete_steps(ckpt_root)]


def find_latest(ckpt_root: str, full: bool = False, group=None) -> Optional[str]:
    """The newest checkpoint under ``ckpt_root`` that passes :func:`verify_checkpoint`, or None.
    Corrupt or partial ones are skipped with a warning naming the file. Under a process group,
    rank 0 decides and broadcasts, so all ranks agree."""
    result = None
    if _rank(group) == 0:
        for path in reversed(list_checkpoints(ckpt_root)):
            try:
                verify_checkpoint(path, full=full)
            except CheckpointError as exc:
                warnings.warn(f"skipping checkpoint: {exc}", stacklevel=2)
                continue
            result = path
            break
    return _broadcast_obj(result, group)


def checkpoint_step(path: str) -> int:
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step-XXXXXXXX)")
    return int(m.group(1))


# ---------------------------------------------------------------- load
def load_checkpoint(path: str, model_parts: Sequence[nn.Module], optimizers: Sequence,
                    group=None, verify: bool = True) -> dict:
    """Load model (+ optimizer) state from ``path`` into this layout; return this rank's ``extra``
    (rank 0's when the checkpoint had fewer ranks). Collective over ``group``.

    Raises CheckpointError naming the file when the checkpoint is incomplete or corrupt (checked
    against the manifest by rank 0 before anything is touched, so all ranks raise together).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    error = None
    if _rank(group) == 0 and verify:
        try:
            verify_checkpoint(path, full=True)
        except CheckpointError as exc:
            error = str(exc)
    error = _broadcast_obj(error, group)
    if error:
        raise CheckpointError(error)

    parts, opts = list(model_parts), list(optimizers or [])
    model_raw, optim_raw, owners = _raw_states(parts, opts)
    # request per-expert keys where the model holds experts as local slices
    request = {"model": expert_templates(model_raw, owners)}
    if opts:
        request["optim"] = expert_templates(optim_raw, owners)
    use_dist = dist.is_available() and dist.is_initialized()
    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), process_group=group, no_dist=not use_dist)
    except Exception as exc:  # noqa: BLE001 - DCP wraps per-rank failures
        raise CheckpointError(f"checkpoint {path}: cannot load model/optimizer state: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    model_sd = merge_expert_keys(request["model"], model_raw, owners)
    for part in parts:
        keys = set(_part_keys(part))
        set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in keys}, options=_options())
    if opts:
        optim_sd = merge_expert_keys(request["optim"], optim_raw, owners)
        with torch.no_grad():
            for key, target in optim_raw.items():
                if isinstance(target, torch.Tensor) and optim_sd[key] is not target:
                    _copy_into(target, optim_sd[key])
        _set_optim_hyper(parts, opts, optim_sd)

    return _load_extra(path, _rank(group))


def _copy_into(target, value) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor):
        target.to_local().copy_(value.to_local() if isinstance(value, DTensor) else value)
    else:
        target.copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def _part_keys(part: nn.Module) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(part, options=_options()).keys())


def _load_extra(path: str, rank: int) -> dict:
    fp = os.path.join(path, f"extra-rank{rank:05d}.pt")
    if not os.path.isfile(fp):
        fp = os.path.join(path, "extra-rank00000.pt")
    if not os.path.isfile(fp):
        return {}
    try:
        return torch.load(fp, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path}: cannot read {fp}: {exc}") from None


def resume_latest(ckpt_root: str, model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                  group=None) -> Optional[tuple[str, dict]]:
    """``train.resume=auto``: load the newest loadable checkpoint, falling back to older ones when
    one is corrupt (with a warning naming the file). Returns (path, extra) or None if there is none."""
    candidates = list(reversed(list_checkpoints(ckpt_root))) if _rank(group) == 0 else None
    candidates = _broadcast_obj(candidates, group)
    for path in candidates:
        try:
            return path, load_checkpoint(path, model_parts, optimizers, group=group)
        except CheckpointError as exc:
            if _rank(group) == 0:
                warnings.warn(f"skipping checkpoint: {exc}", stacklevel=2)
    return None
