"""A rank's plain read of resolved.yaml (paralayer/config/plain.py, resolved.py; issue #36) builds the Config the
OmegaConf path built, field for field, and a rank's start-up no longer imports omegaconf."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paralayer import config as config_mod
from paralayer.config import plain, resolved

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def old_read(path: str, overrides: tuple = ()) -> config_mod.Config:
    """What paralayer/runtime/rank_entry.py:load_run did before issue #36's change."""
    from omegaconf import OmegaConf

    cfg = config_mod.from_yaml_file(path)
    if overrides:
        merged = OmegaConf.merge(OmegaConf.create(config_mod.to_dict(cfg)), OmegaConf.from_dotlist(list(overrides)))
        cfg = config_mod.from_dict(OmegaConf.to_container(merged))
    return cfg


def typed(tree):
    """A tree with each leaf's type beside it: 1 and 1.0 (or True and 1) differ here."""
    if isinstance(tree, dict):
        return {k: typed(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [typed(v) for v in tree]
    return (type(tree).__name__, tree)


def assert_same(new: config_mod.Config, old: config_mod.Config) -> None:
    assert typed(config_mod.to_dict(new)) == typed(config_mod.to_dict(old))
    assert typed(resolved.to_dict(new)) == typed(config_mod.to_dict(old))  # the rank's to_dict (open_logger)
    assert new == old


@functools.lru_cache(maxsize=None)
def resolved_text(recipe: str, *overrides: str) -> str:
    """The resolved.yaml the launcher writes for ``recipe`` (kept: tiny and tiny-moe are written for
    a dozen cases, each the same text)."""
    return config_mod.to_yaml(config_mod.load_config([f"recipe={recipe}", *overrides]))


def write_resolved(tmp_path: Path, recipe: str, *overrides: str) -> str:
    path = tmp_path / f"{recipe}.yaml"
    path.write_text(resolved_text(recipe, *overrides))
    return str(path)


def test_every_shipped_recipe_reads_the_same(tmp_path):
    assert len(RECIPES) >= 20
    for name in RECIPES:
        path = write_resolved(tmp_path, name)
        assert_same(resolved.read_resolved(path), old_read(path))
        plain.build_config(plain.load_yaml(Path(path), "recipe"))  # the plain path itself: no Unsure


def test_a_planted_difference_fails(tmp_path, monkeypatch):
    """The comparison above sees a reader that turns one float into an int."""
    path = write_resolved(tmp_path, "tiny")
    real = plain._value

    def planted(hint, value):
        out = real(hint, value)
        return int(out) if hint is float and out == 1.0 else out

    monkeypatch.setattr(plain, "_value", planted)
    with pytest.raises(AssertionError):
        assert_same(resolved.read_resolved(path), old_read(path))


OVERRIDES = [
    ("train.resume=auto",),
    ("train.resume=auto", "train.steps=2", "checkpoint.every=0"),  # benchmarks/rank_startup.py's
    ("cluster.slurm.time_min=30", "cluster.slurm.srun_args=[--a, --b]", "train.lr=1e-3", "train.spike.window=7"),
    ("parallel.pp_layout=[2,2]", "parallel.pp=2", "data.path=null", "train.tokens=2e9"),
    ("cluster.slurm.sbatch_extra.mail_type=END", "cluster.slurm.sbatch_extra.x.y=1", "sweep.a=[1,2]"),
    ("logging.profile.ranks=[0,1]", "train.stop_at_step=3", "train.stop_at_step=4"),  # the last one wins
    ("train.lr=1", "train.grad_clip=2"),  # ints in float fields: 1.0, 2.0
    ("run.name=123", "train.lr=1"),  # an int in a str field: OmegaConf's path decides ("123")
    ("model.moe.capacity_factor=1.25", "parallel.sequence_parallel=true", "train.resume=/x/y"),
]


@pytest.mark.parametrize("overrides", OVERRIDES)
def test_overrides_merge_the_same(tmp_path, overrides):
    path = write_resolved(tmp_path, "tiny-moe")
    base = resolved.read_resolved(path)
    new = resolved.with_overrides(base, overrides)
    assert_same(new, old_read(path, overrides))
    if "run.name=123" not in overrides:  # the plain path itself took them (no OmegaConf fallback)
        plain.build_config(plain.merge(plain.as_dict(base), plain.dotlist(overrides)))


@pytest.mark.parametrize("bad", ["train.bogus=1", "train.spike.bogus=1", "bogus.x=1", "bogus=1",
                                 "train.resum=auto"])
def test_an_unknown_key_is_the_same_error(tmp_path, bad):
    path = write_resolved(tmp_path, "tiny")
    with pytest.raises(config_mod.ConfigError) as old:
        old_read(path, ("train.resume=auto", bad))
    with pytest.raises(config_mod.ConfigError) as new:
        resolved.with_overrides(resolved.read_resolved(path), ("train.resume=auto", bad))
    assert str(new.value) == str(old.value)
    assert new.value.field == bad.partition("=")[0].split(".x")[0] or new.value.field == "bogus"
    assert "unknown key" in str(new.value)


def test_a_bad_value_is_the_same_error(tmp_path):
    path = write_resolved(tmp_path, "tiny")
    for bad in ("train.steps=abc", "train.steps=0", "model=3"):
        with pytest.raises(config_mod.ConfigError) as old:
            old_read(path, (bad,))
        with pytest.raises(config_mod.ConfigError) as new:
            resolved.with_overrides(resolved.read_resolved(path), (bad,))
        assert str(new.value) == str(old.value)


@pytest.mark.parametrize("text", [
    "recipe: tiny\ntrain:\n  steps: 3\n  steps: 4\n",  # a duplicate key
    "recipe: tiny\ntrain: {steps: 3\n",  # a syntax error
    "recipe: tiny\ndata:\n  blend: [{path: a, weight: 1}, {path: b, weight: 2.5}]\n",
    "recipe: tiny\ntrain: &t {steps: 3}\n",  # an anchor: OmegaConf's loader reads it
    "recipe: tiny\ncluster:\n  slurm:\n    srun_args: [1, --x]\n",  # an int in a List[str]: "1"
    "recipe: tiny\ntrain:\n  steps: '7'\n",  # a string in an int field: 7
    "recipe: tiny\nrun:\n  name: 12\n",
    "recipe: tiny\nbogus: 1\n",
])
def test_odd_files_read_the_same(tmp_path, text):
    """What to_yaml never writes: the plain reader hands it to OmegaConf's path, same result or error."""
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    try:
        old = old_read(str(path))
    except config_mod.ConfigError as exc:
        with pytest.raises(config_mod.ConfigError) as new:
            resolved.read_resolved(str(path))
        assert str(new.value) == str(exc)
        return
    assert_same(resolved.read_resolved(str(path)), old)


def test_a_rank_start_up_imports_no_omegaconf(tmp_path):
    from paralayer.dispatch import prepare_run_dir
    from paralayer.resolve.plan import resolve

    cfg = config_mod.load_config(["recipe=tiny", f"run.dir={tmp_path / 'r'}", "train.resume=/some/ckpt"])
    run_dir = prepare_run_dir(cfg, resolve(cfg))
    code = ("import sys\nimport paralayer.runtime.rank_entry as r\n"
            f"cfg, plan = r.load_run({run_dir!r}, ('train.resume=auto',))\n"
            "assert 'omegaconf' not in sys.modules, 'omegaconf imported'\n"
            "import json; print(json.dumps([cfg.train.resume, plan.to_dict() is not None]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr[-2000:]
    # no checkpoint yet: the restart keeps the user's train.resume (rank_entry.restart_resume)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == ["/some/ckpt", True]
