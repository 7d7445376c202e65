"""A sweep's shared base, merged once: each run is the base plus its few ``key=value``.

Why: loading a recipe is an OmegaConf merge of the schema, the profile and the recipe chain
(~20-50 ms); a 256-run sweep that reloads it per run spends seconds before it resolves anything.
Here the base is merged and typed once; a run copies the typed base (a dataclass deepcopy) and
sets each override through a copy of the base's own OmegaConf node for that field, so the value
is converted and checked exactly as a full load would. Whatever this path cannot take as it
stands (a reference ``${...}``, a list or map value, a key under a map field, ``recipe=`` or
``cluster=``, or any error) goes through the full :func:`load_config`, which also words the error.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from omegaconf import DictConfig, ValueNode
from omegaconf._utils import format_and_raise
from omegaconf.errors import OmegaConfBaseException

from paralayer.config import load
from paralayer.config.schema import Config, ConfigError


class SweepBase:
    """The fixed overrides of a sweep, merged and typed once."""

    def __init__(self, fixed: list[str]):
        self.fixed = list(fixed)
        self._merged: Optional[DictConfig] = None
        self._raw: Optional[Config] = None
        try:
            merged, layers, dotted = load.merged_config(self.fixed)
            if load.has_references(layers, dotted):
                return  # a run's values could change what a reference reads: full loads
            self._raw = load.typed_config(merged, layers, dotted, validate=False)
            self._merged = merged
        except Exception:  # noqa: BLE001 - the full load of each run words the error
            self._merged = self._raw = None

    def load(self, extra: list[str]) -> Config:
        """The base plus ``extra`` (``key=value`` each), as :func:`load_config` would give it."""
        cfg = self._fast(extra)
        return cfg if cfg is not None else load.load_config(self.fixed + list(extra))

    def _fast(self, extra: list[str]) -> Optional[Config]:
        if self._raw is None:
            return None
        values = []
        for item in extra:
            key, _, value = item.partition("=")
            key = load.ALIASES.get(key.strip().lstrip("+"), key.strip().lstrip("+"))
            if not self._maybe_key(key):
                load._parse_overrides([item])  # the full load's key syntax check, then its unknown key
                raise load._unknown_key_error(key)
            node = self._leaf(key)
            if node is None or "${" in value or value.lstrip().startswith(("[", "{")):
                return None
            parsed = load._parse_value(key, value)  # a ConfigError here is the full load's too
            scratch = copy.deepcopy(node)
            try:
                scratch._set_value(parsed)  # the schema's conversion and type check for this field
            except OmegaConfBaseException as exc:
                try:  # OmegaConf's own wording ($VALUE filled in), as a full load's update gives it
                    format_and_raise(node=scratch, key=None, value=parsed, msg=str(exc), cause=exc)
                except OmegaConfBaseException as formatted:
                    raise load._wrap(formatted, key) from None
            except Exception:  # noqa: BLE001 - the full load names the field
                return None
            values.append((key, scratch._value()))
        cfg = copy.deepcopy(self._raw)
        for key, value in values:
            *path, name = key.split(".")
            obj: Any = cfg
            for part in path:
                obj = getattr(obj, part)
            setattr(obj, name, value)
        try:
            load.finish_config(cfg, [o.partition("=")[0] for o in self.fixed + list(extra)])
        except ConfigError:
            raise  # the same per-field checks a full load runs
        except Exception:  # noqa: BLE001
            return None
        return cfg

    @staticmethod
    def _maybe_key(key: str) -> bool:
        """False for a key no full load would take (so a sweep over a typo costs no full loads)."""
        return key in ("recipe", "cluster") or key in load.all_keys() or key.split(".")[0] == "sweep" \
            or key.startswith("cluster.slurm.sbatch_extra.")

    def _leaf(self, key: str) -> Optional[ValueNode]:
        """The base's node for a schema leaf (not a section, not a map field's own key)."""
        if key in ("recipe", "cluster") or key not in load.all_keys() or key.split(".")[0] == "sweep":
            return None
        node: Any = self._merged
        for part in key.split("."):
            if not isinstance(node, DictConfig):
                return None
            node = node._get_node(part)
            if node is None:
                return None
        return node if isinstance(node, ValueNode) else None
