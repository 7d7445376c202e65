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


# ---------------------------------------------------------------- issue 16: the front door
@pytest.mark.parametrize("ov,field,says", [
    ("model.n_layers=" + "1" + "0" * 30, "model.n_layers", "bound"),
    ("cluster.device_memory_gib=nan", "cluster.device_memory_gib", "finite"),
    ("cluster.device_memory_gib=inf", "cluster.device_memory_gib", "finite"),
    ("cluster.memory_reserve_gib=nan", "cluster.memory_reserve_gib", "finite"),
    ("parallel.vpp=" + str(2 ** 63), "parallel.vpp", "bound"),
    ("parallel.dp=" + str(10 ** 9), "parallel.dp", "bound"),
    ("parallel.tp=" + str(2 ** 63), "parallel.tp", "bound"),
    ("parallel.pp=1000000", "parallel.pp", "bound"),
    ("train.lr=nan", "train.lr", "finite"),
    ("train.beta1=-0.1", "train.beta1", "[0, 1)"),
    ("train.beta2=1", "train.beta2", "[0, 1)"),
    ("train.adam_eps=0", "train.adam_eps", "(0"),
    ("train.weight_decay=nan", "train.weight_decay", "finite"),
    ("train.seed=" + str(10 ** 30), "train.seed", "bound"),
    ("train.seed=-1", "train.seed", "bound"),
    ("cluster.inter_node_gbps=0", "cluster.inter_node_gbps", "(0"),
    ("cluster.intra_node_gbps=-5", "cluster.intra_node_gbps", "(0"),
    ("cluster.peak_tflops=nan", "cluster.peak_tflops", "finite"),
    ("recipe=" + "a" * 300, "recipe", "too long"),
    ("run.name=" + "a" * 300, "run.name", "at most 128"),
    ("run.name=${oc.env:WANDB_API_KEY}", "run.name", "reads the environment"),
    ("run.name=${oc.env:UNSET}", "run.name", "reads the environment"),
    ("data.path=x-${oc.decode:'1'}", "data.path", "not a plain reference"),
    ("model.d_model=${model.nope}", "model.d_model", "not found"),
    ("parallel.pp_layout=${model}", "parallel.pp_layout", ""),
    ("parallel.ep_dispatch=nodes", "parallel.ep_dispatch", "flat, node"),
])
def test_bad_values_rejected_naming_the_field(ov, field, says):
    with pytest.raises(ConfigError) as exc:
        load_config([ov])
    assert exc.value.field == field, exc.value
    assert says in exc.value.message


def test_plain_references_stay_allowed():
    cfg = load_config(["run.name=run-${model.d_model}", "train.micro_batch=${train.global_batch}",
                       "train.global_batch=8", "parallel.tp=1"])
    assert cfg.run.name == "run-128" and cfg.train.micro_batch == 8


def _recipe(tmp_path, text: str) -> str:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return f"recipe={p}"


@pytest.mark.parametrize("text,field,says", [
    ("base: tiny\ncluster: {slurm: {sbatch_extra: [1]}}\n", "cluster.slurm.sbatch_extra", "mapping"),
    ("base: tiny\nmodel: 5\n", "model", "mapping"),
    ("base: tiny\ntrain: {lr: [1]}\n", "train.lr", "single value"),
    ("base: ${model.d_model}\n", "base", "not a file name"),
    ("base: tiny\nrun: {name: '${oc.env:HOME}'}\n", "run.name", "reads the environment"),
    ("base: tiny\nsweep: {run.name: '${oc.env:HOME}'}\n", "sweep.run.name", "reads the environment"),
    ("- 1\n", "recipe", "mapping"),
    ("base: tiny\nmodel:\n  d_model: [1, 2\n  n_layers: 3\n", "recipe", "line 4"),
    ("base: tiny\ncheckpoint:\n  every: \x1f\n", "recipe", "line 3"),
])
def test_recipe_file_errors_name_the_field_or_line(tmp_path, text, field, says):
    with pytest.raises(ConfigError) as exc:
        load_config([_recipe(tmp_path, text)])
    assert exc.value.field == field, exc.value
    assert says in exc.value.message, exc.value.message


@pytest.mark.parametrize("content,says", [
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, '
     '"vocab_size": 100, "rope_scaling": "yarn"}', "'rope_scaling' must be an object"),
    ('{"hidden_size": null, "num_attention_heads": 4}', "'hidden_size' must be a whole number"),
    ('{"hidden_size": 64, "num_attention_heads": 0}', "'num_attention_heads' must be >= 1"),
    ('{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 5000, "intermediate_size": 128, '
     '"vocab_size": 100}', "model.n_layers"),
    ("garbage{", "not valid JSON"),
])
def test_malformed_hf_config_names_model_init(tmp_path, content, says):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError) as exc:
        load_config([f"model.init=hf:{tmp_path}", "parallel.tp=1"])
    assert exc.value.field == "model.init" and says in exc.value.message, exc.value.message


def test_checkpoint_async_is_an_alias_of_async_save(tmp_path):
    from paralayer.config import load_config

    assert load_config(["checkpoint.async=true"]).checkpoint.async_save is True
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: tiny\ncheckpoint: {async: true}\n")
    assert load_config([f"recipe={recipe}"]).checkpoint.async_save is True
    assert load_config([]).checkpoint.async_save is False
