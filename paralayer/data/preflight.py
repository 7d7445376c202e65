"""What can be known about the data before any rank starts, without torch: the files exist, can
be read, are not empty, and the format is one we read. ``--dry-run`` (cli.py) reports these as plan
errors (exit 2); the runtime's readers (readers.py) find the rest and name the line or row. Indexed
shards (headers, dtypes, token counts) and blend weights are checked by the resolver
(paralayer/resolve/data_plan.py), which puts them in the plan."""
from __future__ import annotations

import os
from typing import Any, List

from paralayer.data.errors import DataError
from paralayer.inputs.untrusted import forbidden
from paralayer.resolve.data_plan import valid_shares

FORMATS = ("text", "jsonl", "parquet", "tokens", "indexed")


def data_files(path: Any) -> List[str]:
    """The files ``data.path`` names: the file itself, a directory's visible files (sorted), or a
    list of those (in order)."""
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in data_files(p)]
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError as exc:
            raise DataError(f"cannot list the directory ({exc.strerror})", file=path) from None
        files = sorted(os.path.join(path, f) for f in names
                       if not f.startswith(".") and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise DataError("the directory holds no files", file=path)
        for f in files:  # a link in the folder to the environment or a device is never read
            bad = forbidden(f)
            if bad:
                raise DataError(f"links to a file under {bad}: the environment and devices are never read as data",
                                file=f)
        return files
    if not os.path.exists(path):
        raise DataError("no such file or directory", file=path)
    if not os.path.isfile(path):
        raise DataError("not a regular file or directory", file=path)
    return [path]


def check_file(path: str) -> None:
    """Readable and not empty, else DataError naming the file."""
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError as exc:
        raise DataError(f"cannot be read ({exc.strerror})", file=path) from None
    if not first:
        raise DataError("the file is empty", file=path)


def check_data(data_cfg: Any) -> list[tuple[str, str]]:
    """(field, message) for every problem found in ``data_cfg`` (DataConfig) before launch."""
    errors: list[tuple[str, str]] = []
    if data_cfg.format not in FORMATS:
        errors.append(("data.format", f"{data_cfg.format!r} is not one of {', '.join(FORMATS)}"))
    tok = getattr(data_cfg, "tokenizer", None)
    if tok and data_cfg.format != "tokens":
        try:
            if not os.path.isfile(tok):
                raise DataError("no such file", file=tok)
            check_file(tok)
        except DataError as exc:
            errors.append(("data.tokenizer", f"{exc.file}: {exc.reason}"))
    errors += _check_valid(data_cfg)
    if data_cfg.format == "indexed":
        return errors  # the resolver reads the shards' headers (resolve/data_plan.py)
    blend = list(getattr(data_cfg, "blend", None) or [])
    paths = [(f"data.blend[{i}].path", e.get("path") if hasattr(e, "get") else None) for i, e in enumerate(blend)]
    for fld, path in paths or [("data.path", data_cfg.path)]:
        if path is None:
            continue
        try:
            for f in data_files(path):
                check_file(f)
        except DataError as exc:
            errors.append((fld, f"{exc.file}: {exc.reason}"))
    return errors


def shared_files(data_cfg: Any, valid_path: Any) -> List[str]:
    """The files validation (``valid_path``) and training (data.path / data.blend) both read."""
    return valid_shares(data_cfg, valid_path)


def _check_valid(data_cfg: Any) -> list[tuple[str, str]]:
    """``data.valid`` (validation): its files exist and can be read (a file it shares with training
    is reported by the resolver, resolve/data_plan.py)."""
    valid = getattr(data_cfg, "valid", None)
    if not valid or data_cfg.format == "indexed":
        return []
    try:
        for f in data_files(valid):
            check_file(f)
    except DataError as exc:
        return [("data.valid", f"{exc.file}: {exc.reason}")]
    return []
