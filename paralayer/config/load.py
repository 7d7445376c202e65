"""Loading recipes: the schema (``paralayer.config.schema``) merged with OmegaConf, strict about every key.

A recipe is YAML; it may name a parent with ``base: NAME`` and a cluster profile with
``cluster: NAME``. Overrides come from the command line as ``dotted.key=value``. Every mistake
becomes a :class:`ConfigError` that names the field and, where it helps, the valid choices or the
nearest valid key. This module imports no torch.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from paralayer.config import plain, recipes
from paralayer.config.keys import (  # noqa: F401 - part of this module's API
    _check_keys,
    _check_override_shape,
    _kind,
    _unknown_key_error,
    all_keys,
    nearest_key,
)
from paralayer.config.schema import (  # noqa: F401 - the schema's names are this module's API too
    BACKENDS,
    COMPILE_BACKENDS,
    DATA_FORMATS,
    DEVICES,
    PRECISIONS,
    PROFILES_DIR,
    RECIPES_DIR,
    RECOMPUTE,
    REPO_ROOT,
    ROUTERS,
    SCHEDULES,
    WANDB_MODES,
    CheckpointConfig,
    ClusterConfig,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RunConfig,
    SlurmConfig,
    TrainConfig,
    WandbConfig,
)
from paralayer.config.validate import _choice, _positive, validate_values  # noqa: F401 - this module's API too
from paralayer.inputs import bounds, depth, interpolation, untrusted
from paralayer.inputs.echo import one_line


def _wrap(exc: OmegaConfBaseException, context: str = "") -> ConfigError:
    key = getattr(exc, "full_key", None) or context or "recipe"
    text = str(exc).split("\n")[0]
    if len(text) > 200:
        text = text[:197] + "..."
    if type(exc).__name__ in ("ConfigKeyError", "ConfigAttributeError") and "not in struct" in str(exc).lower() \
            or "Key '" in text and "not in" in text:
        return _unknown_key_error(key)
    if "incompatible container types" in text:  # a map where a list belongs, or the reverse
        return ConfigError(key, "holds a mapping where a list belongs, or a list where a mapping belongs")
    if type(exc).__name__ == "ValidationError":
        value = repr(getattr(exc, "value", None))
        value = value if len(value) <= 60 else value[:57] + "..."
        return ConfigError(key, f"invalid value {value} ({text})")
    return ConfigError(key, text)


# ---------------------------------------------------------------- loading
def recipe_names() -> list[str]:
    return recipes.names("recipes")  # the lookup order: paralayer/config/recipes.py


def profile_names() -> list[str]:
    return recipes.names("profiles")


def _safe_path(field_name: str, name: str) -> Path:
    """A file name the user typed, checked before the filesystem sees it (NUL, 255-byte parts)."""
    if not isinstance(name, str) or not name or "\x00" in name or "${" in name:
        raise ConfigError(field_name, f"'{str(name)[:60]}' is not a file name")
    if len(name) > 4096 or any(len(part.encode("utf-8", "replace")) > 255 for part in name.split("/")):
        raise ConfigError(field_name, f"the name is too long ({len(name)} characters; at most 255 per path part)")
    return Path(name)


def _exists(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _recipe_path(name: str) -> Path:
    p = _safe_path("recipe", name)
    if p.suffix in (".yaml", ".yml") and _exists(p):
        return p
    cand = recipes.find("recipes", name)
    if cand is not None:
        return cand
    choices = ", ".join(recipe_names())
    raise ConfigError("recipe", f"no recipe '{name[:80]}'; valid recipes: {choices} (or a path to a .yaml file)")


def _load_yaml(path: Path, field_name: str) -> dict:
    """A YAML file as a plain dict, its texts checked for resolvers (nothing is resolved here)."""
    try:  # OmegaConf's own YAML dialect (and its alias-expansion limit), without its grammar check
        from omegaconf._yaml import get_yaml_loader
    except ImportError:  # omegaconf < 2.4
        from omegaconf._utils import get_yaml_loader

    try:  # it reads OMEGACONF_MAX_YAML_EXPANDED_NODES from the environment
        loader = get_yaml_loader()
    except ValueError:
        var = "OMEGACONF_MAX_YAML_EXPANDED_NODES"
        raise ConfigError(var, f"the environment variable is {one_line(os.environ.get(var, ''), 40)!r}; valid: a "
                          "positive integer or 'none' (unset: 10,000)") from None
    return plain.load_yaml(path, field_name, loader)


def _recipe_chain(name: str, seen: tuple[str, ...] = ()) -> list[dict]:
    """The recipe and its ancestors (``base: NAME``), root first."""
    path = _recipe_path(name)
    if str(path) in seen:
        raise ConfigError("base", f"recipe inheritance loops through {path}")
    if len(seen) > 32:
        raise ConfigError("base", "recipe inheritance is more than 32 levels deep")
    node = _load_yaml(path, "recipe")
    base = node.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError("base", f"{path}: base must name a recipe, got {base!r}")
    if base is not None:
        _safe_path("base", base)
    chain = _recipe_chain(base, seen + (str(path),)) if base else []
    return chain + [node]


def _profile(name: str, field_name: str = "cluster") -> dict:
    p = _safe_path(field_name, name)
    path = p if name.endswith((".yaml", ".yml")) else recipes.find("profiles", name)
    if path is None or not _exists(path):
        raise ConfigError(field_name, f"no cluster profile '{name[:80]}'; valid profiles: {', '.join(profile_names())}")
    node = _load_yaml(path, "cluster")
    node.setdefault("name", Path(name).stem)
    return node


# Spellings a user may type that cannot be dataclass fields (``async`` is a Python keyword).
ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def _unalias(node: dict) -> dict:
    """A recipe node with aliased keys under their field names (``checkpoint: {async: true}``)."""
    for alias, name in ALIASES.items():
        section, _, key = alias.partition(".")
        sub = node.get(section) if isinstance(node, dict) else None
        if isinstance(sub, dict) and key in sub:
            if name.partition(".")[2] in sub:
                raise ConfigError(alias, f"given together with {name}; use one")
            sub[name.partition(".")[2]] = sub.pop(key)
    return node


def _parse_overrides(overrides: list[str]) -> tuple[Optional[str], Optional[str], list[str]]:
    recipe, cluster, rest = None, None, []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(ov[:80], "overrides take the form key=value (e.g. parallel.tp=2)")
        key, _, value = ov.partition("=")
        key = key.strip().lstrip("+")
        key = ALIASES.get(key, key)
        depth.check_value(key[:80] or "(empty key)", value)  # every value, before any parser sees it
        if len(key) > 256:
            raise ConfigError(key[:60] + "...", f"is not a dotted key of the recipe ({len(key):,} characters; the "
                              "longest is under 60)")
        if not key or not all(part and (part.replace("_", "a").replace("-", "a").isalnum()) for part in key.split(".")):
            raise ConfigError(key[:80] or "(empty key)", "is not a dotted key (e.g. parallel.tp=2)")
        if key == "recipe":
            recipe = value
        elif key == "cluster":
            cluster = value
        else:
            rest.append(f"{key}={value}")
    return recipe, cluster, rest


def _parse_value(key: str, value: str) -> Any:
    """A command-line value: YAML lists/maps (``[7,8,7]``) parsed, the rest as OmegaConf reads it;
    ``${...}`` kept as a reference (resolved later, against the recipe), resolvers refused."""
    interpolation.check_text(key, value)
    depth.check_value(key, value)
    if value in ("", "null", "~"):  # YAML's null (``model.moe.capacity_factor=null``: dropless)
        return None
    if value.lstrip().startswith(("[", "{")):
        import yaml

        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        interpolation.check_tree(parsed, key + ".")
        return parsed
    return value


def _pick_profile(chain: list[dict], ov_cluster: Optional[str]) -> tuple[Optional[str], str]:
    """The most derived recipe names the profile; ``cluster: {name: P, nodes: 64}`` is a profile
    plus the recipe's own sizing, dropped when the command line picks another profile."""
    cluster_name, field_name = ov_cluster, "cluster"
    for node in reversed(chain):
        c = node.get("cluster", None)
        if isinstance(c, str):
            node.pop("cluster")
            if not cluster_name:
                cluster_name = c
        elif isinstance(c, dict) and isinstance(c.get("name"), str):
            if ov_cluster and ov_cluster != c.get("name"):
                node.pop("cluster")
            elif not cluster_name:
                cluster_name, field_name = c.get("name"), "cluster.name"
    return cluster_name, field_name


def _apply_overrides(merged: DictConfig, dotted: list[str]) -> None:
    for item in dotted:
        key, _, value = item.partition("=")
        if key.split(".")[0] == "sweep":
            continue
        if key not in all_keys() and not key.startswith("cluster.slurm.sbatch_extra."):
            raise _unknown_key_error(key)
        try:
            parsed = _parse_value(key, value)
            _check_override_shape(key, parsed)
            OmegaConf.update(merged, key, parsed, merge=True)
        except OmegaConfBaseException as exc:
            raise _wrap(exc, key) from None
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(key, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def load_config(overrides: list[str] | None = None, recipe: str | None = None) -> Config:
    """Build the typed config from ``recipe=NAME cluster=NAME key=value ...``."""
    merged, layers, dotted = merged_config(overrides, recipe)
    return typed_config(merged, layers, dotted)


def merged_config(overrides: list[str] | None = None, recipe: str | None = None) -> tuple[DictConfig, list, list[str]]:
    """The recipe chain, its profile and the overrides merged (nothing resolved yet): the merged
    tree, the plain layers it came from, and the dotted overrides."""
    overrides = list(overrides or [])
    ov_recipe, ov_cluster, dotted = _parse_overrides(overrides)
    recipe = ov_recipe or recipe or "tiny"
    chain = _recipe_chain(recipe)
    cluster_name, cluster_field = _pick_profile(chain, ov_cluster)
    for node in chain:
        _check_keys(_unalias(node), Config)
    profile = _profile(cluster_name or "local", cluster_field)
    _check_keys(profile, ClusterConfig, "cluster.")
    layers: list[Any] = [{"cluster": profile}, *chain]
    merged = _schema_tree()
    for layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise _wrap(exc) from None
    merged.recipe = Path(recipe).stem
    _apply_overrides(merged, dotted)
    if has_references(layers, dotted):  # bound what ${...} expands to before OmegaConf resolves it
        interpolation.check_expansion(interpolation.flatten(OmegaConf.to_container(merged, resolve=False)))
    return merged, layers, dotted


@functools.lru_cache(maxsize=1)
def _schema_tree() -> DictConfig:
    """The schema's defaults as a tree, built once (40 ms of the 100 ms a load takes here: every
    CLI call and test loads configs). Never changed in place: ``OmegaConf.merge`` copies its first
    argument before merging into it."""
    return OmegaConf.structured(Config)


def has_references(layers: list, dotted: list[str]) -> bool:
    return any("${" in d.partition("=")[2] for d in dotted) or bool(interpolation.references(layers))


def typed_config(merged: DictConfig, layers: list, dotted: list[str], validate: bool = True) -> Config:
    """The merged tree as the typed Config (references resolved), checked field by field."""
    untrusted.check_bools(layers, dotted)
    try:
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        if not getattr(exc, "full_key", None):  # a reference that resolved to the wrong kind of value
            refs = [d.partition("=")[0] for d in dotted if "${" in d.partition("=")[2]]
            refs += interpolation.references(layers)
            if refs:
                raise _wrap(exc, refs[0]) from None
        raise _wrap(exc) from None
    if validate:
        finish_config(cfg, [d.partition("=")[0] for d in dotted])
    return cfg


def finish_config(cfg: Config, overridden: list[str]) -> None:
    """The shape from ``model.init=hf:PATH`` and the per-field checks, in place."""
    if isinstance(cfg.model.init, str) and cfg.model.init.startswith("hf:"):
        _apply_hf_shape(cfg, overridden)
    validate_values(cfg)


def _apply_hf_shape(cfg: Config, overridden: list[str]) -> None:
    """model.init=hf:PATH: the model's shape comes from PATH/config.json (seq_len stays the recipe's)."""
    from paralayer.families import HFFormatError, apply_hf_config

    path = cfg.model.init[3:]
    try:
        apply_hf_config(cfg.model, path, keep_seq_len=True)
    except HFFormatError as exc:
        raise ConfigError("model.init", str(exc)) from None
    except (KeyError, ValueError, OSError, TypeError) as exc:
        raise ConfigError("model.init", f"cannot read {path}/config.json: {exc}") from None
    for name in bounds.INT_BOUNDS:  # the shape came from the file: name the field the user typed
        if name.startswith("model.") and name.split(".")[-1] not in overridden and name not in overridden:
            try:
                bounds.check_int(name, bounds.get(cfg, name))
            except ConfigError as exc:
                raise ConfigError("model.init", f"{path}/config.json gives {exc.field} that {exc.message}") from None


# ---------------------------------------------------------------- round trips
def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_dict(data: dict) -> Config:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), data)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise _wrap(exc) from None
    validate_values(cfg)
    return cfg


def from_yaml_file(path: str | os.PathLike) -> Config:
    """A run directory's resolved.yaml (or any full recipe) back into a Config."""
    return from_dict(_load_yaml(Path(path), "recipe"))


def sweep_axes(cfg_sweep: dict, overrides: list[str]) -> dict[str, list[str]]:
    """Sweep axes from a recipe's ``sweep:`` block and ``key=a,b,c`` overrides (with -m)."""
    axes: dict[str, list[str]] = {}
    for key, values in (cfg_sweep or {}).items():
        if isinstance(values, (list, ListConfig)):
            axes[key] = [str(v) for v in values]
        else:
            axes[key] = [s.strip() for s in str(values).split(",")]
    for ov in overrides:
        key, _, value = ov.partition("=")
        if "," in value and not value.startswith("["):
            axes[key.strip()] = [s.strip() for s in value.split(",")]
    return axes
