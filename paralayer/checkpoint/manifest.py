"""Integrity of a checkpoint: per-rank digests at save, one manifest, verification of what is read.

Why this shape: a checkpoint of a large model is terabytes written by thousands of ranks; no one
process can hash it inside a collective's timeout. So each rank digests only the files it wrote
(its DCP shard files, its extra state; rank 0 also ``.metadata``) right after writing them, in
parallel with every other rank, and writes ``digests-rankNNNNN.json``. Rank 0 merges those small
files into the ``COMPLETE`` manifest. On load, each rank checks exactly the bytes it reads: a DCP
shard file is digested per storage item (the (offset, length) slices DCP reads one at a time), so a
rank that loads one slice of another rank's file verifies that slice and nothing else.

The hash is xxHash's XXH3-128: it detects accidental damage (truncation, flipped bits, a file
overwritten by another save) at memory speed. It is not a defence against tampering (see
docs/checkpoints.md, Trust boundary).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from typing import IO, Any, Iterable, Optional

import xxhash

COMPLETE = "COMPLETE"
FORMAT = 2
HASH = "xxh3_128"
_CHUNK = 8 << 20
_DIGESTS_RE = re.compile(r"^digests-rank(\d{5})\.json$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory and the bad file."""


class CheckpointDamaged(CheckpointError):
    """The bytes on disk do not match what was written: missing, truncated or corrupt files, or an
    unreadable manifest. Such a checkpoint is set aside as ``step-N.damaged``."""


# ---------------------------------------------------------------- digests
def digest_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def digest_file(path: str, offset: int = 0, length: Optional[int] = None) -> str:
    """XXH3-128 of ``length`` bytes of ``path`` from ``offset`` (the whole file by default)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length if length is not None else -1
        while left != 0:
            b = f.read(_CHUNK if left < 0 else min(_CHUNK, left))
            if not b:
                break
            h.update(b)
            if left > 0:
                left -= len(b)
    return h.hexdigest()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(_CHUNK):
            h.update(b)
    return h.hexdigest()


def digests_name(rank: int) -> str:
    return f"digests-rank{rank:05d}.json"


def rank_digests(root: str, names: Iterable[str], segments: dict[str, list[tuple[int, int]]]) -> dict:
    """{name: {size, digest}} for whole files, {name: {size, segments: [[off, len, digest]]}} for DCP
    shard files whose storage items ``segments`` lists (one digest per item, as DCP reads them)."""
    out: dict[str, Any] = {}
    for name in sorted(set(names)):
        fp = os.path.join(root, name)
        entry: dict[str, Any] = {"size": os.path.getsize(fp)}
        if name in segments:
            entry["segments"] = [[off, ln, digest_file(fp, off, ln)] for off, ln in sorted(segments[name])]
        else:
            entry["digest"] = digest_file(fp)
        out[name] = entry
    return out


def write_json_durable(path: str, obj: Any, sync: bool = True) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_digests(root: str, rank: int, files: dict) -> None:
    """Not fsynced: only rank 0 reads it, into the manifest, which is."""
    write_json_durable(os.path.join(root, digests_name(rank)), {"rank": rank, "files": files}, sync=False)


def ranks_with_digests(root: str) -> set[int]:
    try:
        return {int(m.group(1)) for m in map(_DIGESTS_RE.match, os.listdir(root)) if m}
    except FileNotFoundError:
        return set()


def merge_digests(root: str, world: int) -> dict:
    """The files of every rank's digest file, merged (rank 0 calls this once all ``world`` exist)."""
    files: dict[str, Any] = {}
    for r in range(world):
        fp = os.path.join(root, digests_name(r))
        with open(fp) as f:
            part = json.load(f)["files"]
        for name, info in part.items():
            if name in files and files[name] != info:
                raise CheckpointError(f"checkpoint {root}: {name} digested differently by two ranks")
            files[name] = info
    return files


def write_manifest(root: str, step: int, world: int, files: dict) -> None:
    write_json_durable(os.path.join(root, COMPLETE),
                       {"format": FORMAT, "hash": HASH, "step": step, "world_size": world, "files": files})


# ---------------------------------------------------------------- verify
def read_manifest(path: str) -> dict:
    """The parsed manifest of checkpoint ``path``; CheckpointError (Damaged) naming the file."""
    marker = os.path.join(path, COMPLETE)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: not a directory")
    if not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path}: no {COMPLETE} marker ({marker}): the save did not finish")
    try:
        with open(marker) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
            raise TypeError("'files' is not a {name: {size, ...}} mapping")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointDamaged(f"checkpoint {path}: corrupt manifest {marker}: {exc}") from None
    if ".metadata" not in files:
        raise CheckpointDamaged(f"checkpoint {path}: manifest {marker} lists no .metadata file")
    return manifest


def check_file(path: str, name: str, info: dict, full: bool) -> None:
    """Presence and size of one manifest entry; with ``full`` also its digest(s)."""
    fp = os.path.join(path, name)
    if not os.path.isfile(fp):
        raise CheckpointDamaged(f"checkpoint {path}: missing file {fp}")
    size = os.path.getsize(fp)
    if size != info["size"]:
        raise CheckpointDamaged(f"checkpoint {path}: file {fp} has {size} bytes, the manifest says "
                                f"{info['size']} (truncated or overwritten)")
    if not full:
        return
    if "digest" in info and digest_file(fp) != info["digest"]:
        raise CheckpointDamaged(f"checkpoint {path}: file {fp} does not match its {HASH} digest (corrupt)")
    if "sha256" in info and _sha256(fp) != info["sha256"]:  # format 1 manifests (rank 0 hashed everything)
        raise CheckpointDamaged(f"checkpoint {path}: file {fp} does not match its sha256 checksum (corrupt)")
    for off, ln, want in info.get("segments", ()):
        if digest_file(fp, off, ln) != want:
            raise CheckpointDamaged(f"checkpoint {path}: file {fp} bytes {off}..{off + ln} do not match their "
                                    f"{HASH} digest (corrupt)")


def verify_checkpoint(path: str, full: bool = True, names: Optional[Iterable[str]] = None) -> dict:
    """Check ``path`` against its manifest; return the manifest or raise CheckpointError naming the
    offending file. ``full=False`` checks presence and sizes only (cheap: no file is read).
    ``names``: only these files (what one rank reads)."""
    manifest = read_manifest(path)
    files = manifest["files"]
    for name in sorted(files if names is None else names):
        if name not in files:
            raise CheckpointDamaged(f"checkpoint {path}: {name} is not in the manifest {os.path.join(path, COMPLETE)}")
        check_file(path, name, files[name], full)
    return manifest


def verifying_reader(path: str, manifest: dict):
    """A DCP FileSystemReader that checks the digest of every storage item it reads (check
    ``.metadata`` before reading it); a mismatch raises CheckpointDamaged naming the file."""
    from torch.distributed.checkpoint import FileSystemReader

    files = manifest["files"]
    whole_checked: set[str] = set()
    if not callable(getattr(FileSystemReader, "_slice_file", None)):  # the private hook every read goes through
        raise CheckpointError(f"checkpoint {path}: this torch's FileSystemReader has no _slice_file; cannot verify "
                              f"what is read (paralayer is tested on torch 2.11 and 2.13)")

    class _Reader(FileSystemReader):
        def _slice_file(self, file: IO[bytes], sinfo) -> IO[bytes]:
            name = os.path.basename(sinfo.relative_path)
            fp = os.path.join(path, name)
            info = files.get(name)
            if info is None:
                raise CheckpointDamaged(f"checkpoint {path}: {fp} is read but not in the manifest")
            want = {(off, ln): d for off, ln, d in info.get("segments", ())}.get((sinfo.offset, sinfo.length))
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            if want is None and "digest" not in info and "sha256" not in info:
                raise CheckpointDamaged(f"checkpoint {path}: {fp} bytes {sinfo.offset}..{sinfo.offset + sinfo.length}"
                                        f" have no digest in the manifest")
            if len(data) != sinfo.length:
                raise CheckpointDamaged(f"checkpoint {path}: file {fp} ends before byte "
                                        f"{sinfo.offset + sinfo.length} (truncated)")
            if want is not None and digest_bytes(data) != want:
                end = sinfo.offset + sinfo.length
                raise CheckpointDamaged(f"checkpoint {path}: file {fp} bytes {sinfo.offset}..{end} do not match "
                                        f"their {HASH} digest (corrupt)")
            if want is None and name not in whole_checked:  # a whole-file digest: check the file once
                check_file(path, name, info, full=True)
                whole_checked.add(name)
            return io.BytesIO(data)

    return _Reader(path)
