"""A run directory's resolved.yaml back into a Config without OmegaConf: a rank's start-up path
(issue #36: a restarted rank paid ``import omegaconf`` for a file that is already resolved).

Why: resolved.yaml is the launcher's fully resolved, validated Config (``to_yaml``), so reading it
needs no merge of recipes, no references and no resolvers: PyYAML (with OmegaConf's YAML dialect:
its float rule, no timestamps, duplicate keys refused), the schema's dataclasses, the launcher's
``key=value`` overrides merged as OmegaConf merges a dotlist, and the same per-field checks
(validate.py). The launcher's loading (recipes, CLI, sweeps) stays on OmegaConf (load.py).

How it stays identical: each value is taken only when its type is already the field's (an int
in a float field becomes a float, as OmegaConf converts it); anything else (a string in an int
field, a map for a list, a reference, a key with escapes) raises :class:`_Unsure` and the caller
takes the OmegaConf path, which gives its own result or error. An unknown key is refused here with
the error the OmegaConf path gives (``_unknown_key_error``). tests/test_config_plain.py checks
both readers field for field on every shipped recipe. Imports neither OmegaConf nor torch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from paralayer.config import depth, interpolation, untrusted
from paralayer.config.keys import _unknown_key_error
from paralayer.config.schema import Config, ConfigError
from paralayer.config.validate import validate_values


class _Unsure(Exception):
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
    key refused (the one place OmegaConf's loader refuses what PyYAML takes in such a file)."""
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
    anchors and merge keys (never in a file ``to_yaml`` wrote) to OmegaConf's (:class:`_Unsure`)."""
    import yaml

    untrusted.check_file(str(path), field_name)  # not /proc, /sys, /dev (links followed), not a FIFO
    depth.check_file_size(path, field_name)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(depth.MAX_FILE_BYTES + 1)
        depth.check_yaml_text(text, field_name, str(path))  # before the recursive composer sees it
        if loader is None and ("&" in text or "<<" in text):
            raise _Unsure(f"{path}: anchors or merge keys")
        data = yaml.load(text, Loader=loader or plain_loader())
        data = {} if data is None else data
    except (ConfigError, _Unsure):
        raise
    except yaml.YAMLError as exc:
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


def _value(hint: Any, value: Any) -> Any:
    """``value`` as a field of type ``hint`` holds it after OmegaConf's merge and to_object, where
    that needs no conversion beyond int → float; otherwise :class:`_Unsure`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise _Unsure(hint)
        return _value(rest[0], value)
    if hint is Any:
        if isinstance(value, str) and "${" in value:
            raise _Unsure(value)
        return copy.deepcopy(value)
    if value is None:
        raise _Unsure("None in a field that is not Optional")
    if hint is bool:
        if type(value) is bool:
            return value
        raise _Unsure(value)
    if hint is int:
        if type(value) is int:
            return value
        raise _Unsure(value)
    if hint is float:
        if type(value) in (int, float):
            return float(value)
        raise _Unsure(value)
    if hint is str:
        if type(value) is str and "${" not in value:
            return value
        raise _Unsure(value)
    if origin in (list, typing.List):
        if type(value) is not list:
            raise _Unsure(value)
        item = args[0] if args else Any
        return [_value(item, v) for v in value]
    if origin in (dict, typing.Dict):
        if type(value) is not dict or any(type(k) is not str for k in value):
            raise _Unsure(value)
        item = args[1] if len(args) > 1 else Any
        return {k: _value(item, v) for k, v in value.items()}
    raise _Unsure(hint)


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """The dataclass ``cls`` from a plain mapping: fields it lacks keep their defaults, a key it
    lacks is the OmegaConf path's unknown-key error."""
    if type(data) is not dict:
        raise _Unsure(prefix or "the document")
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


def _dict(obj: Any, hint: Any = None) -> Any:
    if dataclasses.is_dataclass(obj):
        hints = _hints(type(obj))
        return {f.name: _dict(getattr(obj, f.name), hints[f.name]) for f in dataclasses.fields(obj)}
    return _value(hint, obj)


def to_dict(cfg: Config) -> dict:
    """``paralayer.config.to_dict`` (OmegaConf's to_container of the structured config) without
    OmegaConf: nested dicts and lists, float fields as floats; an unusual value (one the field's
    type does not describe) goes through OmegaConf."""
    try:
        return _dict(cfg)
    except _Unsure:
        from paralayer.config import load

        return load.to_dict(cfg)


# ---------------------------------------------------------------- overrides
def _dotlist(overrides: Sequence[str]) -> dict:
    """``key=value`` items as the nested mapping OmegaConf.from_dotlist builds: values read as YAML
    (OmegaConf's dialect), a later item merged over an earlier one."""
    import yaml

    tree: dict = {}
    for item in overrides:
        if not isinstance(item, str) or "\\" in item or "[" in item.partition("=")[0]:
            raise _Unsure(item)
        key, eq, text = item.partition("=")
        if "${" in text:
            raise _Unsure(item)
        try:
            value = yaml.load(text, Loader=plain_loader()) if eq else None
        except yaml.YAMLError:
            raise _Unsure(item) from None
        parts = key.split(".")
        if not all(parts):
            raise _Unsure(item)
        node = tree
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if type(nxt) is not dict:
                raise _Unsure(item)
            node = nxt
        node[parts[-1]] = _merge(node[parts[-1]], value) if parts[-1] in node else value
    return tree


def _merge(base: Any, over: Any) -> Any:
    """OmegaConf's merge of two plain trees: maps merged key by key, anything else replaced."""
    if type(over) is dict:
        if base is None:
            return copy.deepcopy(over)
        if type(base) is not dict:
            raise _Unsure(over)
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if type(base) is dict and over is not None:
        raise _Unsure(over)
    return copy.deepcopy(over)


def from_dict(data: dict) -> Config:
    """``paralayer.config.from_dict`` for a resolved tree, without OmegaConf where it can."""
    try:
        cfg = _build(Config, data)
    except _Unsure:
        from paralayer.config import load

        return load.from_dict(data)
    validate_values(cfg)
    return cfg


def read_resolved(path: str) -> Config:
    """resolved.yaml (or any full recipe without ``base:``) as ``paralayer.config.from_yaml_file``
    reads it."""
    try:
        data = load_yaml(Path(path), "recipe")
    except _Unsure:
        from paralayer.config import load

        data = load._load_yaml(Path(path), "recipe")
    return from_dict(data)


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with the launcher's ``key=value`` overrides, as the OmegaConf merge of
    ``config.to_dict(cfg)`` with ``OmegaConf.from_dotlist(overrides)`` and ``from_dict`` built it."""
    try:
        merged = _merge(to_dict(cfg), _dotlist(list(overrides)))
    except _Unsure:
        from omegaconf import OmegaConf

        from paralayer.config import load

        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(load.to_dict(cfg)),
                                                        OmegaConf.from_dotlist(list(overrides))))
    return from_dict(merged)
