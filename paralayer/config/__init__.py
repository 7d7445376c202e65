"""The recipe as a typed config: schema (schema.py), loading, overrides and sweeps (load.py),
and a rank's plain read of resolved.yaml (plain.py, resolved.py); a Hugging Face config.json is read
by its family (paralayer/families/). ``paralayer.config`` is the public face.

The schema's names are here at once; every other name (load_config, to_dict, ...) is load.py's,
imported on first use: load.py imports OmegaConf, which a rank reading resolved.yaml does not
need (resolved.py, issue #36)."""
from __future__ import annotations

import importlib
import os
from typing import Any

from paralayer.config.schema import (  # noqa: F401 - names callers import from paralayer.config
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    MoEConfig,
)

_HERE = os.path.dirname(os.path.abspath(__file__))


def __getattr__(name: str) -> Any:
    """load.py's names (what ``from paralayer.config.load import *`` gave), on first use; a
    submodule's name is left to the import system (``from paralayer.config import cp_window``)."""
    if name.startswith("__") or os.path.exists(os.path.join(_HERE, name + ".py")) \
            or os.path.isdir(os.path.join(_HERE, name)):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    load = importlib.import_module("paralayer.config.load")
    try:
        value = getattr(load, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value
