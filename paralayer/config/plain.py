"""The plain reader of a run directory's resolved.yaml: PyYAML and the schema's dataclasses, no
OmegaConf (issue #36: a restarted rank paid ``import omegaconf`` for a file that is already
resolved). resolved.py puts it on a rank's path; load.py reads recipes with its YAML part.

Why: resolved.yaml is the launcher's fully resolved, validated Config (``to_yaml``), so reading it
needs no merge of recipes, no references and no resolvers: PyYAML (with OmegaConf's YAML dialect:
its float rule, no timestamps, duplicate keys refused), the schema's dataclasses, and the
launcher's ``key=value`` overrides merged as OmegaConf merges a dotlist. The launcher's loading
(recipes, CLI, sweeps) stays on OmegaConf (load.py).

How it stays identical: each value is taken only when its type is already the field's (an int
in a float field becomes a float, as OmegaConf converts it); anything else (a string in an int
field, a map for a list, a reference, a key with escapes, anchors) raises :class:`Unsure` and
resolved.py takes the OmegaConf path, which gives its own result or error. An unknown key is
refused here with the error the OmegaConf path gives (``_unknown_key_error``).
tests/test_config_plain.py checks both readers field for field on every shipped recipe. Imports
neither OmegaConf nor torch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from paralayer.config.keys import _unknown_key_error
from paralayer.config.schema import Config, ConfigError
from paralayer.inputs import depth, interpolation, untrusted


class Unsure(Exception):
    """A value the plain reader does not convert itself: the OmegaConf path decides."""


# ---------------------------------------------------------------- YAML
def yaml_error(path: Path, exc: Exception) -> str:
    """'FILE line N: problem' for a YAML syntax error (the parser's own text has no line up front)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    if mark is None and isinstance(getattr(exc, "position", None), int):  # yaml.reader.ReaderError
        try:
            head = path.read_text(encoding="utf-8", errors="replace")[:exc.position]  # type: ignore[attr-defined]
            where = f"{path} line {head.count(chr(10)) + 1}, column {exc.position - head.rfind(chr(10))}"  # type: ignore
        except OSError:
            pass
        problem = f"unacceptable character {chr(exc.character) if isinstance(getattr(exc, 'character', None), int) else getattr(exc, 'character', '?')!r}: {getattr(exc, 'reason', 'control characters are not allowed')}"
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and cmark is not None and mark is not None and cmark.line != mark.line:
        context += f" that starts at line {cmark.line + 1}"
    return f"{where}: {problem}" + (f" ({context})" if context else "")


# OmegaConf's float rule (omegaconf/_yaml.py get_yaml_loader): ``1e-3`` is a float, as in YAML 1.2
_FLOAT = re.compile(r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


@functools.lru_cache(maxsize=1)
def plain_loader() -> type:
    """PyYAML's safe loader with OmegaConf's dialect: its float rule, no timestamps, a duplicate
    key refused (load_yaml then hands the file to OmegaConf's loader, whose error it is)."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class PlainLoader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node, deep=False):  # noqa: ANN001
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:str" and key_node.value in seen:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {key_node.value}",
                                                            key_node.start_mark)
                seen.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    PlainLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    PlainLoader.yaml_implicit_resolvers = {
        key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for key, resolvers in PlainLoader.yaml_implicit_resolvers.items()}
    return PlainLoader


def load_yaml(path: Path, field_name: str, loader: Optional[type] = None) -> dict:
    """A YAML file as a plain dict, its texts checked for resolvers (nothing is resolved here).
    ``loader``: OmegaConf's (the launcher, load.py); None = :func:`plain_loader`, which leaves
    anchors, merge keys and any YAML error (none in a file ``to_yaml`` wrote) to OmegaConf's
    (:class:`Unsure`)."""
    import yaml

    untrusted.check_file(str(path), field_name)  # not /proc, /sys, /dev (links followed), not a FIFO
    depth.check_file_size(path, field_name)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(depth.MAX_FILE_BYTES + 1)
        depth.check_yaml_text(text, field_name, str(path))  # before the recursive composer sees it
        if loader is None and ("&" in text or "<<" in text):
            raise Unsure(f"{path}: anchors or merge keys")
        data = yaml.load(text, Loader=loader or plain_loader())
        data = {} if data is None else data
    except (ConfigError, Unsure):
        raise
    except yaml.YAMLError as exc:
        if loader is None:  # a duplicate key, a python/... tag, a syntax error: OmegaConf's loader says
            raise Unsure(str(path)) from None
        raise ConfigError(field_name, f"invalid YAML at {yaml_error(path, exc)}") from None
    except Exception as exc:  # noqa: BLE001 - unreadable file, bad key types, ...
        raise ConfigError(field_name, f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a mapping of keys (it holds a {type(data).__name__})")
    for k in data:
        if not isinstance(k, str):
            raise ConfigError(field_name, f"{path}: key {k!r} is not a name")
    interpolation.check_tree(data, "" if field_name == "recipe" else f"{field_name}.")
    return data


# ---------------------------------------------------------------- the dataclasses
@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _has_reference(value: Any) -> bool:
    """A ``${...}`` anywhere in a value (OmegaConf would resolve it)."""
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_reference(k) or _has_reference(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_reference(v) for v in value)
    return False


def _value(hint: Any, value: Any) -> Any:
    """``value`` as a field of type ``hint`` holds it after OmegaConf's merge and to_object, where
    that needs no conversion beyond int → float; otherwise :class:`Unsure`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise Unsure(hint)
        return _value(rest[0], value)
    if hint is Any:
        if _has_reference(value):
            raise Unsure(value)
        return copy.deepcopy(value)
    if value is None:
        raise Unsure("None in a field that is not Optional")
    if hint is bool:
        if type(value) is bool:
            return value
        raise Unsure(value)
    if hint is int:
        if type(value) is int:
            return value
        raise Unsure(value)
    if hint is float:
        if type(value) in (int, float):
            return float(value)
        raise Unsure(value)
    if hint is str:
        if type(value) is str and "${" not in value:
            return value
        raise Unsure(value)
    if origin in (list, typing.List):
        if type(value) is not list:
            raise Unsure(value)
        item = args[0] if args else Any
        return [_value(item, v) for v in value]
    if origin in (dict, typing.Dict):
        if type(value) is not dict or any(type(k) is not str for k in value):
            raise Unsure(value)
        item = args[1] if len(args) > 1 else Any
        return {k: _value(item, v) for k, v in value.items()}
    raise Unsure(hint)


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """The dataclass ``cls`` from a plain mapping: fields it lacks keep their defaults, a key it
    lacks is the OmegaConf path's unknown-key error."""
    if type(data) is not dict:
        raise Unsure(prefix or "the document")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key_error(f"{prefix}{key}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _value(hint, value)
    return cls(**kwargs)


def build_config(data: Any) -> Config:
    """The Config of a resolved tree (before the per-field checks); :class:`Unsure` where the
    OmegaConf path must decide."""
    return _build(Config, data)


def as_dict(obj: Any, hint: Any = None) -> Any:
    """``paralayer.config.to_dict`` of a Config; :class:`Unsure` for a value its field's type
    does not describe."""
    if dataclasses.is_dataclass(obj):
        hints = _hints(type(obj))
        return {f.name: as_dict(getattr(obj, f.name), hints[f.name]) for f in dataclasses.fields(obj)}
    return _value(hint, obj)


# ---------------------------------------------------------------- overrides
def dotlist(overrides: Sequence[str]) -> dict:
    """``key=value`` items as the nested mapping OmegaConf.from_dotlist builds: values read as YAML
    (OmegaConf's dialect), a later item merged over an earlier one."""
    import yaml

    tree: dict = {}
    for item in overrides:
        if not isinstance(item, str) or "\\" in item or "[" in item.partition("=")[0]:
            raise Unsure(item)
        key, eq, text = item.partition("=")
        if "${" in text:
            raise Unsure(item)
        try:
            value = yaml.load(text, Loader=plain_loader()) if eq else None
        except yaml.YAMLError:
            raise Unsure(item) from None
        parts = key.split(".")
        if not all(parts):
            raise Unsure(item)
        node = tree
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if type(nxt) is not dict:
                raise Unsure(item)
            node = nxt
        node[parts[-1]] = merge(node[parts[-1]], value) if parts[-1] in node else value
    return tree


def merge(base: Any, over: Any) -> Any:
    """OmegaConf's merge of two plain trees: maps merged key by key, anything else replaced."""
    if type(over) is dict:
        if base is None:
            return copy.deepcopy(over)
        if type(base) is not dict:
            raise Unsure(over)
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if type(base) is dict and over is not None:
        raise Unsure(over)
    return copy.deepcopy(over)
