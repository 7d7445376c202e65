"""Loading recipes: the schema (``paralayer.config.schema``) merged with OmegaConf, strict about every key.

A recipe is YAML; it may name a parent with ``base: NAME`` and a cluster profile with
``cluster: NAME``. Overrides come from the command line as ``dotted.key=value``. Every mistake
becomes a :class:`ConfigError` that names the field and, where it helps, the valid choices or the
nearest valid key. This module imports no torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from paralayer.config import bounds, depth, interpolation, model_checks, recipes
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


def _yaml_error(path: Path, exc: Exception) -> str:
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


def _load_yaml(path: Path, field_name: str) -> dict:
    """A YAML file as a plain dict, its texts checked for resolvers (nothing is resolved here)."""
    import yaml

    try:  # OmegaConf's own YAML dialect (and its alias-expansion limit), without its grammar check
        from omegaconf._yaml import get_yaml_loader
    except ImportError:  # omegaconf < 2.4
        from omegaconf._utils import get_yaml_loader

    depth.check_file_size(path, field_name)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(depth.MAX_FILE_BYTES + 1)
        depth.check_yaml_text(text, field_name, str(path))  # before the recursive composer sees it
        data = yaml.load(text, Loader=get_yaml_loader())
        data = {} if data is None else data
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(field_name, f"invalid YAML at {_yaml_error(path, exc)}") from None
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
    merged = OmegaConf.structured(Config)
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


def has_references(layers: list, dotted: list[str]) -> bool:
    return any("${" in d.partition("=")[2] for d in dotted) or bool(interpolation.references(layers))


def typed_config(merged: DictConfig, layers: list, dotted: list[str], validate: bool = True) -> Config:
    """The merged tree as the typed Config (references resolved), checked field by field."""
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
    from paralayer.config.hf_config import HFFormatError, apply_hf_config

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


def _choice(field_name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(field_name, f"'{value}' is not one of: {', '.join(map(str, choices))}")


def _positive(field_name: str, value: Any, minimum: int = 1) -> None:
    if value is None or value < minimum:
        raise ConfigError(field_name, f"must be >= {minimum}, got {value}")


def validate_values(cfg: Config) -> None:
    """Per-field checks (types are already enforced by the schema); layout rules live in resolve/."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "seq_len"):
        _positive(f"model.{name}", getattr(m, name))
    _positive("model.moe.num_experts", m.moe.num_experts, 0)
    _positive("model.moe.top_k", m.moe.top_k)
    _positive("model.moe.every", m.moe.every)
    _positive("model.moe.ffn_hidden", m.moe.ffn_hidden, 0)
    if m.moe.capacity_factor is not None and m.moe.capacity_factor <= 0:
        raise ConfigError("model.moe.capacity_factor", f"must be > 0 or null (dropless), got {m.moe.capacity_factor}")
    _choice("model.moe.router", m.moe.router, ROUTERS)
    model_checks.check_model_keys(cfg)  # the family keys (head_dim, RoPE kinds, windows, MLA, MTP, groups)
    if not (m.init == "random" or m.init.startswith("hf:")):
        raise ConfigError("model.init", f"'{m.init}' is not one of: random, hf:PATH")
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        _positive(f"parallel.{name}", getattr(p, name))
    if isinstance(p.dp, str):
        if p.dp != "auto":
            try:
                p.dp = int(p.dp)
            except ValueError:
                raise ConfigError("parallel.dp", f"'{p.dp}' is not a positive integer or 'auto'") from None
    if not isinstance(p.dp, str):
        if isinstance(p.dp, bool) or not isinstance(p.dp, int):
            raise ConfigError("parallel.dp", f"'{p.dp}' is not a positive integer or 'auto'")
        _positive("parallel.dp", p.dp)
    _choice("parallel.schedule", p.schedule, SCHEDULES)
    _choice("parallel.zero", p.zero, (0, 1, 2, 3))
    _choice("parallel.recompute", p.recompute, RECOMPUTE)
    if isinstance(p.recompute_every, bool) or not isinstance(p.recompute_every, int) \
            or not 1 <= p.recompute_every <= 1024:
        raise ConfigError("parallel.recompute_every", f"'{p.recompute_every}' is not an integer from 1 to 1024 "
                          "(recompute=full: every k-th layer recomputed)")
    if p.pp_layout is not None:
        if len(p.pp_layout) > 1024 or any(isinstance(x, bool) or (not isinstance(x, int)) or not 1 <= x <= 1024
                                          for x in p.pp_layout):
            raise ConfigError("parallel.pp_layout", "must list positive layer counts (at most 1024 each), one per "
                              "pipeline chunk (at most 1024 chunks)")
    for name in ("global_batch", "micro_batch", "steps"):
        _positive(f"train.{name}", getattr(t, name))
    _positive("train.warmup_steps", t.warmup_steps, 0)
    _positive("train.log_every", t.log_every)
    _positive("train.threads", t.threads, 0)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.compile_backend", t.compile_backend, COMPILE_BACKENDS)
    if t.stop_at_step is not None and not (1 <= t.stop_at_step <= t.steps):
        raise ConfigError("train.stop_at_step", f"must be between 1 and train.steps={t.steps}, got {t.stop_at_step}")
    _choice("data.format", cfg.data.format, DATA_FORMATS)
    c = cfg.cluster
    _choice("cluster.backend", c.backend, BACKENDS)
    _choice("cluster.device", c.device, DEVICES)
    _positive("cluster.nodes", c.nodes)
    if c.devices_per_node is not None:
        _positive("cluster.devices_per_node", c.devices_per_node)
    if c.device_memory_gib is not None and c.device_memory_gib <= 0:
        raise ConfigError("cluster.device_memory_gib", f"must be > 0, got {c.device_memory_gib}")
    if c.peak_tflops is not None and c.peak_tflops <= 0:
        raise ConfigError("cluster.peak_tflops", f"must be > 0, got {c.peak_tflops}")
    _positive("checkpoint.every", cfg.checkpoint.every, 0)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    bounds.check_bounds(cfg)


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
