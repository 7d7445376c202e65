"""Untrusted input, one discipline for every command: the paths a command reads or writes, the
bytes it reads, the nesting it parses and the lines it prints.

Why one module: the front door (recipes, ``data.path``) learned these rules first (bounds.py,
depth.py, echo.py); prepare, report, export, resubmit and slurm take files and folders too, and a
run folder, a cluster profile, a checkpoint or a corpus may come from a shared file system. So:

* a path to read is refused by name when it resolves under /proc, /sys or /dev (the environment,
  devices), and must be a regular file once links are followed: a FIFO or /dev/zero is never
  opened for reading (it would block, or never end);
* a read is bounded: the size is checked before reading, and at most the bound is read;
* JSON nesting is counted by a cheap scan before ``json`` recurses (depth.py);
* an output path must name something visible (not ``''``, ``.``, ``dir/`` or ``.hidden``), in a
  folder that exists or can be made, is writable, and is not under a file;
* every message is one line: :class:`BadInput` escapes what it echoes (echo.py).

A :class:`BadInput` is a :class:`ConfigError`: its ``field`` is the argument, field or file it
names, and every command prints it as ``error: FIELD: MESSAGE`` and exits 2. Imports no torch.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any, Callable, Iterator, Optional, Sequence

from paralayer.config.schema import ConfigError
from paralayer.inputs.depth import MAX_DEPTH, json_depth
from paralayer.inputs.echo import has_unsafe, one_line

#: folders whose files are the environment or devices, never read as input
FORBIDDEN = ("/proc", "/sys", "/dev")
#: each path component (the filesystem's limit), and the whole path (PATH_MAX)
MAX_COMPONENT = 255
MAX_PATH = 4096
#: largest JSON document a command reads whole (plan.json, sweep.json, a manifest)
MAX_JSON_BYTES = 16 << 20
#: largest line of a JSONL file (metrics.jsonl records are ~1 KB)
MAX_LINE_BYTES = 1 << 20
#: largest YAML file (resolved.yaml, a cluster profile) read whole
MAX_YAML_BYTES = 1 << 20


class BadInput(ConfigError):
    """Bad input for a command: exit 2, one line naming ``field`` (an argument, a field or a file)."""

    def __init__(self, field: str, message: str):
        super().__init__(one_line(field, 300), one_line(message, 1500))


def show(path: Any, limit: int = 200) -> str:
    """A path as it may be echoed: one line, escaped, cut to ``limit``."""
    return one_line(str(path), limit)


def _check_name(path: str, field: str) -> None:
    if not isinstance(path, str):
        raise BadInput(field, f"must be a path, got {path!r}")
    if path == "":
        raise BadInput(field, "is empty; it must name a file or folder")
    if "\x00" in path:
        raise BadInput(field, "must not contain NUL characters")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise BadInput(field, f"is {len(path):,} characters long; at most {MAX_PATH}")
    for part in path.split("/"):
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT:
            raise BadInput(field, f"has a name of {len(part)} characters ('{show(part, 40)}'); at most "
                           f"{MAX_COMPONENT} (the filesystem's limit)")


def forbidden(path: str) -> Optional[str]:
    """The forbidden folder ``path`` resolves under (links followed), or None."""
    real = os.path.realpath(path)
    return next((d for d in FORBIDDEN if real == d or real.startswith(d + "/")), None)


def _refuse_forbidden(path: str, field: str) -> None:
    bad = forbidden(path)
    if bad:
        raise BadInput(field, f"'{show(path)}' lies under {bad} (links followed): the environment and devices "
                       "are never read as input")


def check_file(path: str, field: str, max_bytes: Optional[int] = None) -> os.stat_result:
    """A regular file that may be read (links followed only to regular files), of at most
    ``max_bytes``; else BadInput naming ``field`` and the file."""
    _check_name(path, field)
    _refuse_forbidden(path, field)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInput(field, f"{show(path)}: no such file") from None
    except OSError as exc:
        raise BadInput(field, f"{show(path)}: cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(field, f"{show(path)}: is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(field, f"{show(path)}: not a regular file (a FIFO, socket or device is never read)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise BadInput(field, f"{show(path)}: {st.st_size:,} bytes; at most {max_bytes:,}")
    return st


def check_dir(path: str, field: str) -> None:
    """A folder that may be read (not under /proc, /sys, /dev); else BadInput."""
    _check_name(path, field)
    _refuse_forbidden(path, field)
    if not os.path.isdir(path):
        raise BadInput(field, f"{show(path)}: no such folder" if not os.path.exists(path)
                       else f"{show(path)}: not a folder")


def _open(path: str, field: str, max_bytes: Optional[int]):
    check_file(path, field, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInput(field, f"{show(path)}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for a FIFO since the check
        os.close(fd)
        raise BadInput(field, f"{show(path)}: not a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(path: str, field: str, max_bytes: int) -> bytes:
    """The whole file (a regular file of at most ``max_bytes``)."""
    with _open(path, field, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise BadInput(field, f"{show(path)}: more than {max_bytes:,} bytes")
    return data


def read_tail(path: str, field: str, tail_bytes: int = 65536) -> str:
    """The last ``tail_bytes`` of a regular file as text (undecodable bytes replaced)."""
    with _open(path, field, None) as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - tail_bytes))
        return f.read(tail_bytes).decode("utf-8", errors="replace")


def decode(data: bytes, path: str, field: str, line: Optional[int] = None) -> str:
    where = f"{show(path)}{f' line {line}' if line else ''}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(field, f"{where}: not UTF-8 text (byte {exc.start})") from None
    if "\x00" in text:
        raise BadInput(field, f"{where}: holds NUL bytes (binary data, not text)")
    return text


def parse_json(text: str, where: str, field: str) -> Any:
    """``json.loads`` after the nesting is counted (a deep text would exhaust the C stack)."""
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise BadInput(field, f"{where}: nested {depth} levels deep; the limit is {MAX_DEPTH}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadInput(field, f"{where}: not valid JSON ({one_line(str(exc), 120)})") from None


def read_json(path: str, field: str, max_bytes: int = MAX_JSON_BYTES, want: type = dict) -> Any:
    """A JSON file of type ``want`` (bounded, depth-checked); BadInput naming the file otherwise."""
    obj = parse_json(decode(read_bytes(path, field, max_bytes), path, field), show(path), field)
    if want is not None and not isinstance(obj, want):
        raise BadInput(field, f"{show(path)}: must hold a JSON {'object' if want is dict else want.__name__}, "
                       f"got {type(obj).__name__}")
    return obj


def read_yaml(path: str, field: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    """A YAML file (bounded; nesting and alias expansion checked before it is composed)."""
    import yaml

    from paralayer.inputs.depth import check_yaml_text

    text = decode(read_bytes(path, field, max_bytes), path, field)
    check_yaml_text(text, field, show(path))
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise BadInput(field, f"{show(path)}{at}: not valid YAML ({one_line(getattr(exc, 'problem', '') or exc, 100)})") \
            from None
    except RecursionError:
        raise BadInput(field, f"{show(path)}: nested too deeply") from None


def jsonl_records(path: str, field: str, max_line: int = MAX_LINE_BYTES) -> Iterator[tuple[int, Any]]:
    """(line number, object) of each line of a JSONL file. A line that is not JSON is skipped (a
    record cut short by a crash); binary or non-UTF-8 bytes, a line over ``max_line`` bytes or
    nested too deep is BadInput naming the file and line."""
    with _open(path, field, None) as f:
        for n, raw in enumerate(iter(lambda: f.readline(max_line + 1), b""), 1):
            if len(raw) > max_line:
                raise BadInput(field, f"{show(path)} line {n}: longer than {max_line:,} bytes")
            line = decode(raw, path, field, n).strip()
            if not line:
                continue
            depth = json_depth(line)
            if depth > MAX_DEPTH:
                raise BadInput(field, f"{show(path)} line {n}: nested {depth} levels deep; the limit is {MAX_DEPTH}")
            try:
                yield n, json.loads(line)
            except ValueError:
                continue  # a record cut short by a crash


def check_out(path: str, field: str) -> str:
    """An output path (a file, a prefix or a folder) that names something visible in a place that
    can be written: not ``''``/``.``/``..``/``dir/``, no hidden name, not under a file, /proc,
    /sys or /dev; its nearest existing folder writable. Returns the absolute path."""
    _check_name(path, field)
    base = os.path.basename(path)
    if path.endswith("/") or base in ("", ".", ".."):
        raise BadInput(field, f"'{show(path)}' names a folder, not a name to write (give e.g. {show(path.rstrip('/') or '.')}/out)")
    if base.startswith("."):
        raise BadInput(field, f"'{show(path)}' is a hidden name; give a visible one")
    if has_unsafe(path):  # a control, DEL, line separator or bidi override in a file name
        raise BadInput(field, f"'{show(path)}' holds control characters")
    full = os.path.abspath(path)
    bad = forbidden(full) or next((d for d in FORBIDDEN if full.startswith(d + "/")), None)
    if bad:
        raise BadInput(field, f"'{show(path)}' lies under {bad}: nothing is written there")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise BadInput(field, f"'{show(path)}' lies under {show(parent)}, which is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(field, f"'{show(path)}': cannot write in {show(parent)} (permission denied)")
    return full


def same_path(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same file (links followed), or would be."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies under it (links followed)."""
    p, d = os.path.realpath(path), os.path.realpath(folder)
    return p == d or p.startswith(d.rstrip("/") + "/")


def refuse_overwrite(outputs: Sequence[str], inputs: Sequence[str], field: str) -> None:
    """BadInput when an output would write over an input, or an output folder holds one."""
    for out in outputs:
        for inp in inputs:
            if same_path(out, inp) or inside(inp, out):
                raise BadInput(field, f"'{show(out)}' would write over the input {show(inp)}; choose another name")


def require(value: Any, kinds: tuple, field: str, what: str) -> Any:
    """``value`` if it is one of ``kinds`` (a bool is never a number), else BadInput."""
    if isinstance(value, bool) and bool not in kinds:
        raise BadInput(field, f"must be {what}, got {value!r}")
    if not isinstance(value, kinds):
        raise BadInput(field, f"must be {what}, got {show(repr(value), 60)}")
    return value


class ArgParser(__import__("argparse").ArgumentParser):
    """argparse whose usage errors are one BadInput naming the argument (not argparse's two lines
    and its own exit)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        import re

        m = re.match(r"argument ([^:]+): (.*)", message)
        if m:
            raise BadInput(m.group(1).split("/")[-1], m.group(2))
        m = re.match(r"the following arguments are required: (.*)", message)
        if m:
            raise BadInput(m.group(1).split(", ")[0], "is required")
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            raise BadInput(m.group(1).split(" ")[0], f"is not an argument of {self.prog}")
        raise BadInput(self.prog, message)


def guard(prog: str, fn: Callable[[], Any]) -> int:
    """Run a command's body under the discipline: bad input of any kind (BadInput, ConfigError, an
    error carrying ``field``: DataError, ReportError) is one line naming what is wrong, exit 2; an
    unexpected exception is one line naming it as a bug, exit 1; never a traceback."""
    import sys

    def err(msg: str, code: int) -> int:
        print(f"error: {one_line(msg)}", file=sys.stderr)
        return code

    try:
        return int(fn() or 0)
    except SystemExit as exc:  # argparse's --help (0)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else err(str(exc.code), 2))
    except ConfigError as exc:  # BadInput included
        return err(f"{exc.field}: {exc.message}", 2)
    except RecursionError:
        return err(f"{prog}: an input nests too deeply to be read", 2)
    except Exception as exc:  # noqa: BLE001 - every command ends in one line
        if getattr(exc, "field", None):  # DataError, ReportError, DispatchError name their field
            return err(str(exc), 2)
        if isinstance(exc, OSError) and exc.errno is not None:
            name = exc.filename if exc.filename not in (None, "") else repr(exc.filename)
            return err(f"{prog}: {show(name)}: {exc.strerror or type(exc).__name__}", 2)
        return err(f"{prog}: unexpected {type(exc).__name__}: {one_line(str(exc), 300)} (a bug in paralayer: "
                   "please report it)", 1)


def bool_fields() -> set[str]:
    """The dotted names of the schema's boolean fields."""
    import dataclasses

    from paralayer.config.schema import Config

    out: set[str] = set()

    def walk(cls: Any, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if t == "bool":
                out.add(prefix + f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")

    walk(Config, "")
    return out


def check_bools(layers: Sequence[Any], dotted: Sequence[str]) -> None:
    """A boolean field holds true or false, as written: OmegaConf would take ``2`` or ``"yes"``
    (``logging.profile.memory=2``) as true, where every number field refuses a boolean."""
    import yaml

    names = bool_fields()

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in names and v is not None and not isinstance(v, bool) and not _is_ref(v):
                raise BadInput(key, f"must be true or false, got {show(repr(v), 60)}")
            walk(v, key + ".")

    for layer in layers:
        walk(layer, "")
    for d in dotted:
        key, _, text = d.partition("=")
        key = key.strip().lstrip("+")
        if key in names and not _is_ref(text):
            try:
                v = yaml.safe_load(text)
            except yaml.YAMLError:
                continue  # the loader names it
            if v is not None and not isinstance(v, bool):
                raise BadInput(key, f"must be true or false, got {show(text, 60)}")


def _is_ref(v: Any) -> bool:
    return isinstance(v, str) and "${" in v
