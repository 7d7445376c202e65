"""Random recipes (degrees, shapes, batch sizes, wrong types): the resolver never crashes, and every
rejection names a real config field.

Speed: ``load_config`` (OmegaConf) costs tens of ms per call, too slow for 1,000 examples in a few
seconds. So the 1,000-example test loads each base recipe once and applies the random overrides with
a small typed setter (same rule: a value of the wrong type is a ConfigError naming the key) followed by
the schema's own ``validate_values``; a second test sends 50 of them through the real ``load_config``.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import typing

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paralayer import config as config_mod
from paralayer.config import ConfigError, all_keys, load_config
from paralayer.resolve import resolve

KEYS = set(all_keys()) | {"memory", "recipe", "cluster"}
JUNK = st.sampled_from(["x", "-3", "0", "1.5", "", "null", "true", "[1,2]", "1e9", "auto"])


def _int(lo: int, hi: int):
    return st.one_of(st.integers(lo, hi).map(str), JUNK) if hi else st.integers(lo, lo).map(str)


def _maybe(key: str, values, p_junk: bool = True):
    vals = st.one_of(values, JUNK) if p_junk else values
    return st.one_of(st.none(), vals.map(lambda v: f"{key}={v}"))


def _degree():
    # mostly small powers of two (the realistic case), sometimes anything
    return st.one_of(st.sampled_from([1, 1, 1, 2, 2, 4, 8]), st.integers(1, 16)).map(str)


# Built once: constructing strategies inside the composite dominated the run time.
RECIPE = st.sampled_from(["tiny", "tiny", "llama3-8b", "mixtral-8x7b", "llama3-70b"])
CLUSTER = st.sampled_from([None, "local", "h100-80gb-8x", "a100-80gb-8x"])
HEADS = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32])
OPTIONAL = [
    _maybe("parallel.tp", _degree()), _maybe("parallel.pp", _degree()), _maybe("parallel.vpp", _degree()),
    _maybe("parallel.cp", _degree()), _maybe("parallel.ep", _degree()),
    _maybe("parallel.dp", st.one_of(st.just("auto"), _degree())),
    _maybe("parallel.schedule", st.sampled_from(["gpipe", "1f1b", "interleaved", "zbv", "dualpipev", "bogus"])),
    _maybe("parallel.zero", st.integers(-1, 4).map(str)),
    _maybe("parallel.recompute", st.sampled_from(["none", "selective", "full", "some"])),
    _maybe("parallel.sequence_parallel", st.sampled_from(["true", "false", "null"])),
    _maybe("parallel.pp_layout", st.lists(st.integers(0, 6), min_size=1, max_size=6).map(
        lambda xs: "[" + ",".join(map(str, xs)) + "]"), p_junk=False),
    _maybe("model.n_kv_heads", st.sampled_from([1, 2, 3, 4, 8, 16]).map(str)),
    _maybe("model.ffn_hidden", st.integers(1, 4096).map(str)),
    _maybe("model.n_layers", st.integers(1, 96).map(str)),
    _maybe("model.vocab_size", st.integers(1, 130000).map(str)),
    _maybe("model.seq_len", st.sampled_from([1, 7, 64, 96, 128, 100, 4096, 131072]).map(str)),
    _maybe("model.moe.num_experts", st.integers(0, 16).map(str)),
    _maybe("model.moe.top_k", st.integers(0, 5).map(str)),
    _maybe("model.moe.ffn_hidden", st.integers(0, 512).map(str)),
    _maybe("model.moe.every", st.integers(0, 4).map(str)),
    _maybe("model.moe.capacity_factor", st.sampled_from(["null", "0.5", "1.25", "-1"])),
    _maybe("train.global_batch", st.integers(0, 4096).map(str)),
    _maybe("train.micro_batch", st.integers(0, 16).map(str)),
    _maybe("train.precision", st.sampled_from(["auto", "fp32", "bf16", "fp8"])),
    _maybe("cluster.nodes", st.integers(0, 64).map(str)),
    _maybe("cluster.devices_per_node", st.sampled_from(["null", "1", "2", "4", "8", "16"])),
    _maybe("cluster.device_memory_gib", st.sampled_from(["null", "0.001", "16", "80", "-1"])),
]
D_MODEL_MULT = st.sampled_from([2, 8, 16, 24, 64])


@st.composite
def recipes(draw):
    ovs = [f"recipe={draw(RECIPE)}"]
    cluster = draw(CLUSTER)
    if cluster:
        ovs.append(f"cluster={cluster}")
    if draw(st.booleans()):
        heads = draw(HEADS)
        ovs += [f"model.n_heads={heads}", f"model.d_model={heads * draw(D_MODEL_MULT)}"]
    for strat in OPTIONAL:
        v = draw(strat)
        if v is not None:
            ovs.append(v)
    return ovs


@functools.lru_cache(maxsize=None)
def _base(recipe: str, cluster: str | None):
    return load_config([f"recipe={recipe}"] + ([f"cluster={cluster}"] if cluster else []))


def _set(cfg, key: str, raw: str) -> None:
    """Typed assignment of one dotted override, as the schema would do it."""
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    hints = typing.get_type_hints(type(node))
    typ = hints[leaf]
    val = yaml.safe_load(raw) if raw != "" else None
    args = typing.get_args(typ)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), typ) if args else typ
    if val is None:
        if not optional:
            raise ConfigError(key, "must not be null")
    elif base is typing.Any:
        pass
    elif base is bool:
        if not isinstance(val, bool):
            raise ConfigError(key, f"invalid value {raw!r}")
    elif base is int:
        if isinstance(val, bool) or not isinstance(val, int):
            raise ConfigError(key, f"invalid value {raw!r}")
    elif base is float:
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            raise ConfigError(key, f"invalid value {raw!r}")
        val = float(val)
    elif base is str:
        val = str(val)
    elif typing.get_origin(base) in (list, typing.List):
        if not isinstance(val, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in val):
            raise ConfigError(key, f"invalid value {raw!r}")
    setattr(node, leaf, val)


def fast_load(ovs: list[str]):
    recipe = next(o.split("=", 1)[1] for o in ovs if o.startswith("recipe="))
    cluster = next((o.split("=", 1)[1] for o in ovs if o.startswith("cluster=")), None)
    cfg = copy.deepcopy(_base(recipe, cluster))
    for o in ovs:
        key, _, raw = o.partition("=")
        if key not in ("recipe", "cluster"):
            _set(cfg, key, raw)
    config_mod.validate_values(cfg)
    return cfg


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(recipes())
def test_random_recipes_never_crash_and_name_a_field(ovs):
    _check(ovs, fast_load)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(recipes())
def test_random_recipes_through_load_config(ovs):
    _check(ovs, load_config)


def _check(ovs, loader):
    try:
        cfg = loader(ovs)
    except ConfigError as exc:
        assert exc.field and isinstance(exc.field, str)
        assert exc.field in KEYS or any(o.startswith(exc.field + "=") for o in ovs), (exc.field, ovs)
        assert exc.message
        return
    plan = resolve(cfg)
    d = json.loads(json.dumps(plan.to_dict()))  # serialisable as the contract says
    for e in d["errors"]:
        assert e["field"] in KEYS, e
        assert e["message"]
    for w in d["warnings"]:
        assert w["field"] in KEYS, w
    assert plan.valid == (not d["errors"])
    mem = d["memory_per_device_bytes"]
    assert mem["total"] == mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"] > 0
    assert 0.0 <= d["bubble_fraction"] and math.isfinite(d["bubble_fraction"])
    if plan.valid:
        g = d["degrees"]
        assert d["world_size"] == g["tp"] * g["pp"] * g["cp"] * g["dp"]
        assert d["microbatches"] * cfg.train.micro_batch * g["dp"] == cfg.train.global_batch
        assert [i for c in d["stage_layers"] for i in c] == list(range(cfg.model.n_layers))
        assert len(d["stage_layers"]) == g["pp"] * g["vpp"]
        assert cfg.model.n_heads % g["tp"] == 0 and cfg.model.n_kv_heads % g["tp"] == 0
        assert d["padded_vocab_size"] % g["tp"] == 0
        if cfg.model.moe.num_experts:
            assert cfg.model.moe.num_experts % g["ep"] == 0 and (g["dp"] * g["cp"]) % g["ep"] == 0
