"""The range of every number and the shape of every text a recipe may hold.

Why bounds: the resolver and the planner do arithmetic and build lists whose size follows the
recipe's sizes and degrees (rank groups, pipeline chunks, layers). Without an upper bound a typo
(``parallel.dp=10**9``, ``model.n_layers=10**30``) turns a sub-second dry run into a hang or an
OverflowError. Why finiteness: torch refuses ``lr=nan`` or a negative beta at step 1, minutes after
the ranks started, and a NaN link speed or peak makes ``--json`` print bare ``NaN`` (not JSON).
Every check here raises a :class:`ConfigError` naming the field and the bound.

The bounds are far beyond any published run (Llama 3 405B: 126 layers, 16,384 GPUs, 128K
context; DeepSeek-V3: 256 experts; Switch-C: 2,048 experts) yet small enough that a dry run stays
well under a second and the planner's search stays bounded.
Imports no torch.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

from paralayer.config.schema import Config, ConfigError

#: Largest world (devices) a plan may describe: 2**17 = 131,072 (the largest published training
#: clusters hold ~100k GPUs); the planner's search grows with the divisors of the world.
MAX_WORLD = 2 ** 17

#: field -> (min, max) for integers, both inclusive.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "model.d_model": (1, 2 ** 17),
    "model.n_layers": (1, 512),  # deepest published LLMs: ~120 layers; pipeline work grows with it
    "model.n_heads": (1, 2 ** 12),
    "model.n_kv_heads": (1, 2 ** 12),
    "model.ffn_hidden": (1, 2 ** 20),
    "model.vocab_size": (1, 2 ** 24),
    "model.seq_len": (1, 2 ** 24),
    "model.moe.num_experts": (0, 2 ** 12),
    "model.moe.top_k": (1, 2 ** 12),
    "model.moe.ffn_hidden": (0, 2 ** 20),
    "model.moe.every": (1, 512),
    "model.moe.shared_ffn_hidden": (0, 2 ** 20),
    "parallel.tp": (1, 2 ** 12),
    "parallel.pp": (1, 512),
    "parallel.vpp": (1, 512),
    "parallel.cp": (1, 2 ** 12),
    "parallel.ep": (1, 2 ** 12),
    "parallel.dp": (1, MAX_WORLD),
    "train.global_batch": (1, 2 ** 24),
    "train.micro_batch": (1, 2 ** 24),
    "train.steps": (1, 10 ** 9),
    "train.warmup_steps": (0, 10 ** 9),
    "train.seed": (0, 2 ** 63 - 1),  # torch.manual_seed takes at most 2**64 - 1; init adds to it
    "train.log_every": (1, 10 ** 9),
    "train.threads": (0, 1024),
    "train.eval_every": (0, 10 ** 9),
    "train.eval_batches": (1, 10 ** 6),
    "cluster.nodes": (1, MAX_WORLD),
    "cluster.devices_per_node": (1, 1024),
    "cluster.slurm.time_min": (1, 10 ** 7),
    "cluster.slurm.cpus_per_task": (1, 1024),
    "cluster.slurm.gpus_per_node": (0, 1024),
    "cluster.slurm.max_requeues": (0, 1000),
    "cluster.slurm.max_restarts": (0, 1000),
    "cluster.max_restarts": (0, 1000),
    "checkpoint.every": (0, 10 ** 9),
    "checkpoint.keep": (1, 10 ** 6),
    "train.spike.window": (1, 10 ** 6),
    "train.rollback_skip_margin": (0, 10 ** 9),
    "logging.profile.start": (0, 10 ** 9),
    "logging.profile.steps": (1, 10 ** 6),
}

#: field -> (min, max, min allowed?, max allowed?, nullable). All must be finite.
FLOAT_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "model.rope_theta": (0.0, 1e12, False, True),
    "model.norm_eps": (0.0, 1.0, False, False),
    "model.init_std": (0.0, 100.0, False, True),
    "model.moe.aux_loss_coef": (0.0, 1e6, True, True),
    "model.moe.capacity_factor": (0.0, 1e6, False, True),
    "model.moe.bias_update_rate": (0.0, 1e6, True, True),
    "train.lr": (0.0, 1e3, False, True),
    "train.min_lr_ratio": (0.0, 1.0, True, True),
    "train.weight_decay": (0.0, 1e6, True, True),
    "train.beta1": (0.0, 1.0, True, False),  # torch.optim.AdamW: 0 <= beta < 1
    "train.beta2": (0.0, 1.0, True, False),
    "train.adam_eps": (0.0, 1.0, False, True),  # AdamW divides by sqrt(v) + eps: eps > 0
    "train.grad_clip": (0.0, 1e12, True, True),  # 0 = no clipping
    "train.collective_timeout_s": (0.0, 86400.0, False, True),
    "checkpoint.timeout_s": (0.0, 7 * 86400.0, False, True),
    "cluster.device_memory_gib": (0.0, 2.0 ** 20, False, True),
    "cluster.peak_tflops": (0.0, 1e7, False, True),
    "cluster.intra_node_gbps": (0.0, 1e7, False, True),
    "cluster.inter_node_gbps": (0.0, 1e7, False, True),
    "cluster.memory_reserve_gib": (0.0, 2.0 ** 20, True, True),
    "train.tokens": (0.0, 1e18, False, True),  # a token budget; null = train.steps
    "cluster.price_per_device_hour": (0.0, 1e9, True, True),
    "train.spike.threshold_sigma": (0.0, 1e6, True, True),  # 0 = off
    "train.hang_timeout_s": (0.0, 86400.0, True, True),  # 0 = off; null = 3/4 of collective_timeout_s
    "logging.straggler_pct": (0.0, 1e6, False, True),
    "data.valid_fraction": (0.0, 1.0, True, False),  # a held-out fraction of each source
}

#: Text fields that name a file or folder: each path component at most 255 bytes (the limit of
#: every common filesystem), the whole at most 4096 (PATH_MAX).
PATH_FIELDS = ("recipe", "data.path", "data.valid", "data.tokenizer", "data.cache_dir", "checkpoint.dir", "run.dir", "cluster.slurm.folder",
               "model.init", "train.resume")
MAX_TEXT = 4096
MAX_COMPONENT = 255
#: Names that become part of a folder or a W&B name (W&B: project names up to 128 characters).
NAME_FIELDS = {"run.name": 128, "logging.wandb.project": 128, "logging.wandb.group": 128, "cluster.name": 128}


def get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_int(name: str, value: Any) -> None:
    lo, hi = INT_BOUNDS[name]
    if value is None and name == "cluster.devices_per_node":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer from {lo} to {hi:,}, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(name, f"must be from {lo} to {hi:,} (the bound), got {_short(value)}")


def _bound_float(name: str, value: Any) -> None:
    lo, hi, lo_ok, hi_ok = FLOAT_BOUNDS[name]
    if value is None and name in ("cluster.device_memory_gib", "cluster.peak_tflops", "model.moe.capacity_factor",
                                  "train.tokens", "cluster.price_per_device_hour", "train.hang_timeout_s"):
        return
    rng = f"{'[' if lo_ok else '('}{lo:g}, {hi:g}{']' if hi_ok else ')'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a finite number in {rng}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number in {rng}, got {value}")
    if value < lo or value > hi or (value == lo and not lo_ok) or (value == hi and not hi_ok):
        raise ConfigError(name, f"must be in {rng}, got {value:g}")


def _short(value: Any) -> str:
    s = str(value)
    return s if len(s) <= 24 else f"{s[:10]}...({len(s)} digits)"


def _check_text(name: str, value: Optional[str]) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise ConfigError(name, f"must be text, got {value!r}")
    if "\x00" in value or any(ord(ch) < 32 and ch not in "\t" for ch in value):
        raise ConfigError(name, "must not contain control characters (NUL, newlines)")
    limit = NAME_FIELDS.get(name, MAX_TEXT)
    if len(value) > limit:
        raise ConfigError(name, f"is {len(value)} characters long; at most {limit}")
    if name in NAME_FIELDS and name != "cluster.name" and any(ch in value for ch in "/\\"):
        raise ConfigError(name, f"must not contain '/' or '\\' (it names a folder and a W&B run), got {value!r}")
    if name in PATH_FIELDS:
        for part in value.replace("\\", "/").split("/"):
            if len(part.encode("utf-8", "replace")) > MAX_COMPONENT:
                raise ConfigError(name, f"has a path component of {len(part)} characters; at most {MAX_COMPONENT} "
                                  "(the filesystem's limit)")


def _texts(cfg: Config) -> list[tuple[str, Any]]:
    out = [(n, get(cfg, n)) for n in PATH_FIELDS + tuple(NAME_FIELDS) if n != "data.path"]
    out += _named_data_paths(cfg)
    s = cfg.cluster.slurm
    for n in ("partition", "account", "qos", "constraint"):
        out.append((f"cluster.slurm.{n}", getattr(s, n)))
    for n in ("srun_args", "setup"):
        for v in getattr(s, n):
            out.append((f"cluster.slurm.{n}", str(v)))
    for k, v in s.sbatch_extra.items():
        out.append((f"cluster.slurm.sbatch_extra.{k}", str(v)))
    out.append(("data.text_field", cfg.data.text_field))
    return out


#: Any other number (fields added later included): finite, and an integer within a signed 64-bit
#: word (what torch and numpy take without OverflowError).
GENERIC_INT = 2 ** 63 - 1
#: Files the recipe may not read: the environment and devices (``/proc/self/environ`` as training
#: data would copy the user's secrets into token caches).
FORBIDDEN_READS = ("/proc", "/sys", "/dev")


def _walk(obj: Any, prefix: str = ""):
    """(dotted name, value) of every leaf of a config dataclass tree (lists and maps included)."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{prefix}{f.name}.")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v, prefix)
    else:
        yield prefix.rstrip("."), obj


def check_generic(cfg: Config) -> None:
    """Every number finite and within 64 bits, every text free of NUL, whatever the field."""
    for name, value in _walk(cfg):
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(name, f"must be a finite number, got {value}")
        if isinstance(value, int) and abs(value) > GENERIC_INT:
            raise ConfigError(name, f"must be within ±{GENERIC_INT:,} (the bound), got {_short(value)}")
        if isinstance(value, str) and "\x00" in value:
            raise ConfigError(name, "must not contain NUL characters")
    reads = [(n, p) for n, p in _named_data_paths(cfg)] + [("data.valid", cfg.data.valid),
                                                          ("data.tokenizer", cfg.data.tokenizer)]
    for name, value in reads:
        forbidden = tuple(d + "/" for d in FORBIDDEN_READS)
        if value and isinstance(value, str) and os.path.realpath(value).startswith(forbidden):
            raise ConfigError(name, f"'{value[:80]}' lies under {', '.join(FORBIDDEN_READS)}: a recipe may not read "
                              "the environment or devices")


def _data_paths(cfg: Config) -> list:
    """data.path (text, or a list of texts under data.format=indexed) and every data.blend path."""
    p = cfg.data.path
    out = list(p) if isinstance(p, (list, tuple)) else [p]
    for e in cfg.data.blend or []:
        if isinstance(e, dict) and "path" in e:
            out += list(e["path"]) if isinstance(e["path"], (list, tuple)) else [e["path"]]
    return out


def _named_data_paths(cfg: Config) -> list:
    """(field, path) of data.path and of every data.blend[i].path (named as such in errors)."""
    p = cfg.data.path
    out = [("data.path", x) for x in (list(p) if isinstance(p, (list, tuple)) else [p])]
    for i, e in enumerate(cfg.data.blend or []):
        if isinstance(e, dict) and "path" in e:
            out += [(f"data.blend[{i}].path", x) for x in (list(e["path"]) if isinstance(e["path"], (list, tuple))
                                                           else [e["path"]])]
    return out


def check_bounds(cfg: Config) -> None:
    """Raise a ConfigError (naming the field and the bound) for the first value out of range: the
    fields' own ranges first, then the generic rule every other number follows."""
    for name in INT_BOUNDS:
        value = get(cfg, name)
        if name == "parallel.dp" and value == "auto":
            continue
        check_int(name, value)
    for name in FLOAT_BOUNDS:
        _bound_float(name, get(cfg, name))
    for name, value in _texts(cfg):
        _check_text(name, value)
    _check_world(cfg)
    check_health(cfg)
    check_generic(cfg)


def check_health(cfg: Config) -> None:
    """Run-health keys (paralayer/runtime/health/watchdog.py, stability.py, metrics/profile.py)."""
    from paralayer.config.schema import NONFINITE_ACTIONS, SPIKE_ACTIONS

    t = cfg.train
    if t.on_nonfinite is not None and t.on_nonfinite not in NONFINITE_ACTIONS:
        raise ConfigError("train.on_nonfinite", f"'{t.on_nonfinite}' is not one of: {', '.join(NONFINITE_ACTIONS)}")
    if t.spike.action not in SPIKE_ACTIONS:
        raise ConfigError("train.spike.action", f"'{t.spike.action}' is not one of: {', '.join(SPIKE_ACTIONS)}")
    if t.hang_timeout_s and t.hang_timeout_s >= t.collective_timeout_s:
        raise ConfigError("train.hang_timeout_s", f"must be shorter than train.collective_timeout_s="
                          f"{t.collective_timeout_s:g} (the watchdog must see a hang first), got {t.hang_timeout_s:g}")
    for r in cfg.logging.profile.ranks or []:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < MAX_WORLD:
            raise ConfigError("logging.profile.ranks", f"must list ranks from 0 to {MAX_WORLD - 1} (or be null: "
                              f"every rank), got {r!r}")


def _check_world(cfg: Config) -> None:
    """The product of the degrees, and nodes × devices per node, stay within MAX_WORLD."""
    p, c = cfg.parallel, cfg.cluster
    degrees = {"parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp}
    if isinstance(p.dp, int):
        degrees["parallel.dp"] = p.dp
    prod = math.prod(degrees.values())
    if prod > MAX_WORLD:
        big = max(degrees, key=lambda k: degrees[k])
        raise ConfigError(big, f"tp·pp·cp{'·dp' if 'parallel.dp' in degrees else ''} = {prod:,} devices exceeds the "
                          f"bound of {MAX_WORLD:,}; lower {big}")
    world = c.nodes * (c.devices_per_node or prod)
    if world > MAX_WORLD:
        raise ConfigError("cluster.nodes", f"cluster.nodes={c.nodes} × {c.devices_per_node or prod} devices per node = "
                          f"{world:,} devices exceeds the bound of {MAX_WORLD:,}")
    if p.vpp * p.pp > 4 * cfg.model.n_layers and p.vpp * p.pp > 64:
        raise ConfigError("parallel.vpp" if p.vpp > p.pp else "parallel.pp",
                          f"pp·vpp = {p.pp * p.vpp} pipeline chunks for model.n_layers={cfg.model.n_layers}: "
                          "each chunk needs at least one layer")
