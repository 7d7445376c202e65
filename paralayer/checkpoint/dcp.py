"""Checkpoints: torch.distributed.checkpoint (DCP) for model + optimizer, atomic and verifiable.

Layout of ``checkpoint.dir``::

    step-00000010/            a COMPLETE checkpoint (only complete ones carry this name)
        .metadata             DCP metadata (global shapes, which file holds which chunk)
        __0_0.distcp ...      DCP shards, one file per writing rank
        extra-rank00000.pt    per-rank small state (LR scheduler, RNG, step, data position),
                              written with torch.save, read back with weights_only=True
        digests-rank00000.json  what each rank digested of the files it wrote (manifest.py)
        COMPLETE              JSON manifest: step, world size, {file: {size, digest(s)}}
    step-00000020.tmp/        a save in progress, or one killed mid-way: ignored, cleaned later
    step-00000005.damaged/    a checkpoint found damaged, set aside (never deleted by us)

A save writes everything into ``step-XXXXXXXX.tmp``; each rank digests what it wrote; rank 0
merges the digests into ``COMPLETE`` (fsynced) and renames the directory to ``step-XXXXXXXX``
(``os.replace``: atomic on POSIX). A kill at any moment leaves the previous checkpoints untouched
plus a ``.tmp`` directory, or the new complete one. With ``async_save`` DCP writes on a
background thread (``dcp.async_save``) and rank 0 completes the checkpoint as soon as every
rank's digests are on disk (checked between steps), or at the next save, at the latest.

What is saved and how it reshards: state.py. Integrity: manifest.py. What is kept: retention.py.
Trust boundary: docs/checkpoints.md.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from paralayer.checkpoint import group as grp
from paralayer.checkpoint.manifest import (
    CheckpointDamaged,
    CheckpointError,
    check_file,
    merge_digests,
    rank_digests,
    ranks_with_digests,
    verify_checkpoint,
    verifying_reader,
    write_manifest,
    write_rank_digests,
)
from paralayer.checkpoint.retention import (
    DAMAGED_RE,
    apply_retention,
    checkpoint_step,
    list_checkpoints,
    set_aside,
    step_dir,
    warn,
)
from paralayer.checkpoint.rng import rng_state, set_rng_state
from paralayer.checkpoint.state import LoadRequest, get_states

__all__ = ["CheckpointError", "CheckpointDamaged", "Checkpointer", "save_checkpoint", "load_checkpoint",
           "resume_latest", "find_latest", "verify_checkpoint", "list_checkpoints", "checkpoint_step",
           "step_dir", "rng_state", "set_rng_state", "get_states"]


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


def _extra_name(rank: int) -> str:
    return f"extra-rank{rank:05d}.pt"


def _write_extra(path: str, extra: dict) -> None:
    with open(path, "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())


def _own_segments(metadata: Any, rank: int) -> dict[str, list[tuple[int, int]]]:
    """The storage items (file → [(offset, length)]) this rank's DCP writer put in its own files."""
    prefix = f"__{rank}_"
    out: dict[str, list[tuple[int, int]]] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = os.path.basename(info.relative_path)
        if name.startswith(prefix):
            out.setdefault(name, []).append((int(info.offset), int(info.length)))
    return out


def _digest_own_files(tmp: str, rank: int, metadata: Any) -> None:
    """Digest what this rank wrote (its shard files, its extra state; rank 0 also .metadata) and
    leave the result in ``digests-rankNNNNN.json``: no collective, every rank in parallel."""
    segments = _own_segments(metadata, rank)
    names = list(segments) + [_extra_name(rank)] + ([".metadata"] if rank == 0 else [])
    write_rank_digests(tmp, rank, rank_digests(tmp, names, segments))


@dataclass
class _Pending:
    step: int
    tmp: str
    final: str
    future: Any = None
    error: Optional[str] = None


class Checkpointer:
    """Saves into ``ckpt_root`` over ``group`` (every rank of it calls :meth:`save` at the same step).

    ``async_save``: DCP writes on a background thread and :meth:`save` returns once the state is
    copied; the checkpoint becomes COMPLETE when :meth:`poll` (called between steps) or
    :meth:`wait` (the next save, the end of the run) sees every rank's digests. ``timeout_s``
    bounds that wait; ``group`` should be a :func:`group.checkpoint_group` with the same timeout.
    """

    def __init__(self, ckpt_root: str, keep: Optional[int] = None, group=None, async_save: bool = False,
                 timeout_s: float = 600.0):
        self.root, self.keep, self.group = ckpt_root, keep, group
        self.async_save, self.timeout_s = bool(async_save), float(timeout_s)
        self.rank, self.world = grp.rank(group), grp.world(group)
        self.pending: Optional[_Pending] = None

    def save(self, step: int, model_parts: Sequence[nn.Module], optimizers: Sequence,
             extra: Optional[dict] = None) -> str:
        """Save model + optimizer (DCP) and ``extra`` (this rank's small state: plain types and
        tensors, read back with ``weights_only=True``) as ``step-XXXXXXXX``; returns that path."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        pend = _Pending(step, step_dir(self.root, step) + ".tmp", step_dir(self.root, step))
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            if os.path.exists(pend.tmp):
                shutil.rmtree(pend.tmp)
            os.makedirs(pend.tmp)
        grp.barrier(self.group)
        states = get_states(model_parts, optimizers)
        extra = dict(extra or {})
        extra.setdefault("step", step)
        _write_extra(os.path.join(pend.tmp, _extra_name(self.rank)), extra)
        writer = dcp.FileSystemWriter(pend.tmp, sync_files=True)
        no_dist = not grp.initialized()
        if not self.async_save:
            metadata = dcp.save(states, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            _digest_own_files(pend.tmp, self.rank, metadata)
            grp.barrier(self.group)
            if self.rank == 0:
                self._complete(pend)
            grp.barrier(self.group)
            return pend.final
        resp = dcp.async_save(states, storage_writer=writer, process_group=self.group, no_dist=no_dist)
        pend.future = getattr(resp, "upload_completion", resp)
        pend.future.add_done_callback(lambda fut, p=pend: self._after_write(p, fut))
        self.pending = pend
        return pend.final

    def _after_write(self, pend: _Pending, fut) -> None:
        """On the writer thread, once DCP is done: digest this rank's files (or record the error)."""
        try:
            _digest_own_files(pend.tmp, self.rank, fut.result())
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            pend.error = f"checkpoint {pend.tmp}: asynchronous save failed on rank {self.rank}: " \
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def poll(self) -> bool:
        """Between steps: complete the pending asynchronous save if every rank has finished
        writing (rank 0 only; others return at once). True when nothing is pending on this rank."""
        pend = self.pending
        if pend is None:
            return True
        if self.rank == 0 and pend.error is None and pend.future.done() \
                and ranks_with_digests(pend.tmp) >= set(range(self.world)):
            self._complete(pend)
            pend.future = None  # completed; wait() only has to join the others
        return False

    def wait(self) -> None:
        """Block until the pending save (if any) is written everywhere and complete."""
        pend, self.pending = self.pending, None
        if pend is None:
            return
        error = None
        if pend.future is not None:
            try:
                pend.future.result(timeout=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001
                error = f"checkpoint {pend.tmp}: asynchronous save failed: {type(exc).__name__}: {exc}"
            error = error or pend.error
        if self.rank == 0 and error is None and pend.future is not None:
            error = self._wait_for_digests(pend)
            if error is None:
                self._complete(pend)
        error = grp.agree(error, self.group)
        if error:
            raise CheckpointError(error)

    def _wait_for_digests(self, pend: _Pending) -> Optional[str]:
        deadline = time.monotonic() + self.timeout_s
        while ranks_with_digests(pend.tmp) < set(range(self.world)):
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - ranks_with_digests(pend.tmp))
                return (f"checkpoint {pend.tmp}: ranks {missing} did not finish writing within "
                        f"checkpoint.timeout_s={self.timeout_s:g} s")
            time.sleep(0.02)
        return None

    def _complete(self, pend: _Pending) -> None:
        """Rank 0: manifest from the gathered digests, atomic rename, then retention."""
        write_manifest(pend.tmp, pend.step, self.world, merge_digests(pend.tmp, self.world))
        _fsync_dir(pend.tmp)
        old = None
        if os.path.exists(pend.final):  # re-saving a step (e.g. after resuming from an older one)
            old = f"{pend.final}.old-{os.getpid()}"
            os.replace(pend.final, old)
        os.replace(pend.tmp, pend.final)
        _fsync_dir(self.root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        apply_retention(self.root, self.keep, current=pend.step)

    def close(self) -> None:
        self.wait()


def save_checkpoint(ckpt_root: str, step: int, model_parts: Sequence[nn.Module], optimizers: Sequence,
                    extra: Optional[dict] = None, group=None, keep: Optional[int] = None) -> str:
    """A synchronous save (see :class:`Checkpointer`); ``keep``: how many verified checkpoints to keep."""
    return Checkpointer(ckpt_root, keep, group).save(step, model_parts, optimizers, extra)


# ---------------------------------------------------------------- load
def find_latest(ckpt_root: str, full: bool = False, group=None) -> Optional[str]:
    """The newest checkpoint under ``ckpt_root`` that passes :func:`verify_checkpoint`, or None.
    Damaged or partial ones are skipped with a warning naming the file. Under a process group,
    rank 0 decides and broadcasts, so all ranks agree."""
    result = None
    if grp.rank(group) == 0:
        for path in reversed(list_checkpoints(ckpt_root)):
            try:
                verify_checkpoint(path, full=full)
            except CheckpointError as exc:
                warn(f"skipping checkpoint: {exc}")
                continue
            result = path
            break
    return grp.broadcast_obj(result, group)


def _reason(exc: BaseException, path: str) -> tuple[str, str]:
    """(kind, message) of a failed load: DCP wraps each rank's error in CheckpointException
    (a BaseException), whose failures hold the original exceptions."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = failures[min(failures)]
        exc = first[0] if isinstance(first, tuple) else first
    if isinstance(exc, CheckpointError):
        return ("damaged" if isinstance(exc, CheckpointDamaged) else "error"), str(exc)
    text = str(exc).strip().splitlines()
    return "error", (f"checkpoint {path}: cannot load model/optimizer state: {type(exc).__name__}"
                     f"{': ' + text[0] if text else ''}")


def _raise(kind_msg: Optional[tuple[str, str]]) -> None:
    if kind_msg:
        kind, msg = kind_msg
        raise (CheckpointDamaged if kind == "damaged" else CheckpointError)(msg)


def _load_extra(path: str, rank: int, manifest: Optional[dict]) -> dict:
    name = _extra_name(rank)
    if not os.path.isfile(os.path.join(path, name)):
        name = _extra_name(0)  # the checkpoint had fewer ranks
    fp = os.path.join(path, name)
    if not os.path.isfile(fp):
        return {}
    if manifest is not None and name in manifest["files"]:
        check_file(path, name, manifest["files"][name], full=True)
    try:
        return torch.load(fp, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path}: cannot read {fp}: {exc}") from None


def load_checkpoint(path: str, model_parts: Sequence[nn.Module], optimizers: Sequence,
                    group=None, verify: bool = True) -> dict:
    """Load model (+ optimizer) state from ``path`` into this layout; return this rank's ``extra``
    (rank 0's when the checkpoint had fewer ranks). Collective over ``group``.

    With ``verify`` every rank checks the manifest, then the digest of every byte it reads
    (``.metadata``, each DCP storage item, its extra state). Whatever fails, on whichever rank
    (torch's CheckpointException included, a BaseException), every rank raises CheckpointError
    naming the directory and the file; CheckpointDamaged when the bytes do not match.
    """
    import torch.distributed.checkpoint as dcp

    manifest, err, req = None, None, None
    try:
        manifest = verify_checkpoint(path, full=False) if verify else None
        if manifest is not None:
            check_file(path, ".metadata", manifest["files"][".metadata"], full=True)
        reader = verifying_reader(path, manifest) if verify else dcp.FileSystemReader(path)
        reader.read_metadata()  # unpickled here, so a bad one is one clean error, not DCP's logged tracebacks
        req = LoadRequest(model_parts, optimizers)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001
        err = _reason(exc, path)
    _raise(grp.agree(err, group))
    rank = grp.rank(group)
    try:
        dcp.load(req.request, storage_reader=reader, process_group=group, no_dist=not grp.initialized())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        err = _reason(exc, path)
    _raise(grp.agree(err, group))
    extra: dict = {}
    try:
        req.apply()
        extra = _load_extra(path, rank, manifest)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001
        err = _reason(exc, path)
    _raise(grp.agree(err, group))
    return extra


def _set_aside_names(ckpt_root: str) -> list[str]:
    if not os.path.isdir(ckpt_root):
        return []
    return sorted(n for n in os.listdir(ckpt_root) if DAMAGED_RE.match(n))


def resume_latest(ckpt_root: str, model_parts: Sequence[nn.Module], optimizers: Sequence,
                  group=None) -> Optional[tuple[str, dict]]:
    """``train.resume=auto``: load the newest checkpoint that loads, falling back past every one
    that does not (naming each and why). Newer checkpoints that failed while an older one loaded
    are set aside as ``step-N.damaged``. Returns (path, extra); None only when ``ckpt_root`` holds
    no checkpoint at all. Raises CheckpointError, naming the directory and every reason, when
    checkpoints exist but none loads."""
    candidates = grp.broadcast_obj(list(reversed(list_checkpoints(ckpt_root))) if grp.rank(group) == 0 else None,
                                   group)
    failed: list[tuple[str, str]] = []
    for path in candidates:
        try:
            extra = load_checkpoint(path, model_parts, optimizers, group=group)
        except CheckpointError as exc:
            failed.append((path, str(exc)))
            if grp.rank(group) == 0:
                warn(f"skipping {exc}")
            continue
        if grp.rank(group) == 0:
            for bad, why in failed:
                set_aside(bad, why)
        return path, extra
    earlier = grp.broadcast_obj(_set_aside_names(ckpt_root) if grp.rank(group) == 0 else None, group)
    if not failed and not earlier:
        return None
    reasons = [f"{os.path.basename(p)}: {why}" for p, why in failed]
    if earlier:
        reasons.append(f"set aside earlier as damaged: {', '.join(earlier)}")
    raise CheckpointError(f"train.resume=auto: checkpoint.dir {ckpt_root} holds checkpoints but none loads "
                          f"(fix or move them, or set train.resume=none to start over): {'; '.join(reasons)}")
