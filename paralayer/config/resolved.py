"""A run directory's resolved.yaml read the way a rank needs it (issue #36): without OmegaConf where
the plain reader (plain.py) is sure of every value, through load.py's OmegaConf path where it is
not (plain.py's docstring says when), so the Config is the same either way. The launcher writes
resolved.yaml (``to_yaml``); paralayer/runtime/rank_entry.py:load_run and the metrics logger's
copy of the config (runtime/train.py) read it through here. Imports no OmegaConf itself."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from paralayer.config import plain
from paralayer.config.schema import Config
from paralayer.config.validate import validate_values


def to_dict(cfg: Config) -> dict:
    """``paralayer.config.to_dict`` (OmegaConf's to_container of the structured config): nested
    dicts and lists, float fields as floats."""
    try:
        return plain.as_dict(cfg)
    except plain.Unsure:
        from paralayer.config import load

        return load.to_dict(cfg)


def from_dict(data: dict) -> Config:
    """``paralayer.config.from_dict`` of a resolved tree."""
    try:
        cfg = plain.build_config(data)
    except plain.Unsure:
        from paralayer.config import load

        return load.from_dict(data)
    validate_values(cfg)
    return cfg


def read_resolved(path: str) -> Config:
    """resolved.yaml (or any full recipe without ``base:``) as ``paralayer.config.from_yaml_file``
    reads it."""
    try:
        data = plain.load_yaml(Path(path), "recipe")
    except plain.Unsure:
        from paralayer.config import load

        data = load._load_yaml(Path(path), "recipe")
    return from_dict(data)


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """``cfg`` with the launcher's ``key=value`` overrides, as the OmegaConf merge of
    ``config.to_dict(cfg)`` with ``OmegaConf.from_dotlist(overrides)`` and ``from_dict`` built it."""
    try:
        merged = plain.merge(to_dict(cfg), plain.dotlist(list(overrides)))
    except plain.Unsure:
        from omegaconf import OmegaConf

        from paralayer.config import load

        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(load.to_dict(cfg)),
                                                        OmegaConf.from_dotlist(list(overrides))))
    return from_dict(merged)
