"""Recipes and the schema: every shipped recipe loads and resolves, mistakes name their key."""
from __future__ import annotations

import pytest

from paralayer.config import ConfigError, load_config, profile_names, recipe_names
from paralayer.resolve import resolve

SHIPPED = ["tiny", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "mixtral-8x7b", "llama3-8b-128k",
           "llama3-8b-512k"]


def test_shipped_recipes_and_profiles_exist():
    assert set(SHIPPED) <= set(recipe_names())
    assert {"local", "a100-80gb-8x", "h100-80gb-8x", "h200-141gb-8x"} <= set(profile_names())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_recipe_resolves_valid_and_fits(name):
    plan = resolve(load_config([f"recipe={name}"]))
    assert plan.errors == [], plan.errors
    assert plan.valid and plan.fits, plan.memory_per_device_bytes


@pytest.mark.parametrize("name,total,active", [
    # published sizes (Meta, Mistral): 8.03B, 70.6B, 405.9B; Mixtral 46.7B total / 12.9B active
    ("llama3-8b", 8.03e9, 8.03e9), ("llama3-70b", 70.55e9, 70.55e9), ("llama3-405b", 405.85e9, 405.85e9),
    ("mixtral-8x7b", 46.70e9, 12.88e9), ("gpt3-175b", 175.2e9, 175.2e9),
])
def test_parameter_counts_match_published_shapes(name, total, active):
    p = resolve(load_config([f"recipe={name}"])).parameters
    assert p["total"] == pytest.approx(total, rel=2e-3)
    assert p["active"] == pytest.approx(active, rel=2e-3)


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError) as exc:
        load_config(["parallel.tpp=2"])
    assert exc.value.field == "parallel.tpp" and "parallel.tp" in exc.value.message


@pytest.mark.parametrize("ov,field", [
    ("parallel.tp=abc", "parallel.tp"), ("train.global_batch=1.5", "train.global_batch"),
    ("parallel.zero=4", "parallel.zero"), ("parallel.schedule=foo", "parallel.schedule"),
    ("parallel.recompute=some", "parallel.recompute"), ("model.n_layers=0", "model.n_layers"),
    ("parallel.dp=-1", "parallel.dp"), ("parallel.dp=many", "parallel.dp"),
])
def test_wrong_types_and_ranges_name_the_key(ov, field):
    with pytest.raises(ConfigError) as exc:
        load_config([ov])
    assert exc.value.field == field


def test_recipe_extends_base_and_cluster_profile_applies():
    cfg = load_config(["recipe=llama3-8b-128k"])
    assert cfg.model.d_model == 4096 and cfg.model.seq_len == 131072  # from llama3-8b, then overridden
    assert cfg.cluster.name == "h100-80gb-8x" and cfg.cluster.nodes == 8


def test_cluster_on_command_line_replaces_recipe_sizing():
    cfg = load_config(["recipe=llama3-70b", "cluster=a100-80gb-8x"])
    assert cfg.cluster.name == "a100-80gb-8x" and cfg.cluster.nodes == 1
    cfg = load_config(["recipe=llama3-70b", "cluster.nodes=4"])
    assert cfg.cluster.name == "h100-80gb-8x" and cfg.cluster.nodes == 4


def test_unknown_recipe_and_profile_list_choices():
    with pytest.raises(ConfigError) as exc:
        load_config(["recipe=nope"])
    assert exc.value.field == "recipe" and "llama3-70b" in exc.value.message
    with pytest.raises(ConfigError) as exc:
        load_config(["cluster=nope"])
    assert exc.value.field == "cluster" and "h100-80gb-8x" in exc.value.message


def test_long_context_recipe_needs_cp():
    """At cp=1 one 512k sequence does not fit an 80 GB device even with tp=8, SP and full recompute."""
    plan = resolve(load_config(["recipe=llama3-8b-512k", "parallel.cp=1", "cluster.nodes=1"]))
    assert plan.valid and not plan.fits
    assert resolve(load_config(["recipe=llama3-8b-512k"])).fits
