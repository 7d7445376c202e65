"""Which keys a recipe may hold and what kind of value each takes: the schema's dotted names, the
nearest valid key for a typo, and the shape checks (a map where a list belongs, a list item that
is itself a list, a dotted key written inside a map) that name the field before OmegaConf merges
anything. Imports no torch."""
from __future__ import annotations

import difflib
import functools
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Optional

from paralayer.config.schema import Config, ConfigError


@functools.lru_cache(maxsize=1)
def _maps() -> tuple:
    """dict and OmegaConf's DictConfig (imported here, not at the top: a rank's plain read of
    resolved.yaml (plain.py) uses this module's key names without loading OmegaConf)."""
    from omegaconf import DictConfig

    return (dict, DictConfig)


@functools.lru_cache(maxsize=1)
def _lists() -> tuple:
    from omegaconf import ListConfig

    return (list, ListConfig)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    if cls is Config and not prefix:
        return list(_all_config_keys())
    return _all_keys(cls, prefix)


@functools.lru_cache(maxsize=1)
def _all_config_keys() -> tuple[str, ...]:
    return tuple(_all_keys(Config, ""))


def _all_keys(cls: type, prefix: str) -> list[str]:
    out = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        out.append(name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_all_keys(type(default), name + "."))
    return out


def nearest_key(key: str) -> Optional[str]:
    keys = all_keys()
    leaf = key.split(".")[-1]
    hits = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if hits:
        return hits[0]
    same_leaf = [k for k in keys if k.split(".")[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    leaves = {k.split(".")[-1]: k for k in keys}
    hits = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
    return leaves[hits[0]] if hits else None


def _unknown_key_error(key: str) -> ConfigError:
    hint = nearest_key(key)
    msg = "unknown key" + (f"; did you mean '{hint}'?" if hint and hint != key else "")
    return ConfigError(key, msg)


def _check_keys(node: Any, cls: type, prefix: str = "") -> None:
    """Unknown keys anywhere in a plain YAML node, with a suggestion; a section (or a map or list
    field, or an item of a list field) given as the wrong kind of value names that field."""
    if not isinstance(node, _maps()):
        raise ConfigError(prefix.rstrip(".") or "recipe", f"must be a mapping of keys, got {_kind(node)}")
    names = {f.name: f for f in fields(cls)}
    for key in node:
        full = f"{prefix}{key}"
        if key not in names:
            if isinstance(key, str) and "." in key:
                raise _dotted_key_error(prefix, key)
            raise _unknown_key_error(full)
        f = names[key]
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        value = node[key]
        if is_dataclass(default):
            if value is not None:
                _check_keys(value, type(default), full + ".")
        elif value is not None:
            _check_shape(full, value, _shape(f.type, default))


def _shape(type_text: Any, default: Any) -> tuple[str, str]:
    """(outer, items) of a schema field: 'map' / 'list' / 'value' / 'any' and, for a list, what
    its items are ('value' or 'any'). From the annotation (``Optional[List[int]]``) or the default."""
    t = str(type_text).replace("typing.", "")
    if t.startswith("Optional[") and t.endswith("]"):
        t = t[len("Optional["):-1]
    if t.startswith("List[") or isinstance(default, list):
        inner = t[len("List["):-1] if t.startswith("List[") else "Any"
        return "list", "value" if inner in ("int", "str", "float", "bool") else "any"
    if t.startswith("Dict[") or isinstance(default, dict):
        return "map", "any"
    if t in ("int", "str", "float", "bool"):
        return "value", "any"
    return "any", "any"


def _check_shape(full: str, value: Any, shape: tuple[str, str]) -> None:
    outer, items = shape
    if outer == "map" and not isinstance(value, _maps()):
        raise ConfigError(full, f"must be a mapping (key: value), got {_kind(value)}")
    if outer == "list" and not isinstance(value, _lists()):
        raise ConfigError(full, f"must be a list, got {_kind(value)}")
    if outer == "value" and isinstance(value, _maps() + _lists()):
        raise ConfigError(full, f"must be a single value, got {_kind(value)}")
    if outer == "list" and items == "value":
        for i, item in enumerate(value):
            if isinstance(item, _maps() + _lists()):
                raise ConfigError(full, f"item {i} must be a single value, got {_kind(item)}")


def _dotted_key_error(prefix: str, key: str) -> ConfigError:
    """``model: {moe.top_k: 1}``: one dotted key inside a map (YAML keeps it as one name)."""
    head, _, rest = key.partition(".")
    full = f"{prefix}{key}"
    if full in all_keys():
        return ConfigError(full, f"a dotted key inside a map is one name in YAML; write it as nested keys: "
                           f"{head}: {{{rest}: ...}}")
    return _unknown_key_error(full)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"[:60]


def _check_override_shape(key: str, value: Any) -> None:
    """A list or map typed on the command line where the field takes another kind names the field."""
    cls, f = Config, None
    for part in key.split("."):
        names = {x.name: x for x in fields(cls)} if is_dataclass(cls) else {}
        f = names.get(part)
        if f is None:
            return  # a key under a map field (cluster.slurm.sbatch_extra.X): anything goes
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        cls = type(default)
    if f is None or value is None:
        return
    if is_dataclass(cls):
        if not isinstance(value, dict):
            raise ConfigError(key, f"is a section: must be a mapping of keys, got {_kind(value)}")
        _check_keys(value, cls, key + ".")
    else:
        _check_shape(key, value, _shape(f.type, cls() if cls in (list, dict) else None))
