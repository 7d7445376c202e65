"""DeepSeek-V3's MTP depths read back from Hugging Face safetensors in DeepSeek's own naming
(``model.layers.{n_layers+k}.*``, as the released checkpoint's layer 61 and our export write them).

The source is transformers' DeepseekV3ForCausalLM (tests/test_hf_deepseek.py's 4 layers, std 0.2)
from save_pretrained, plus an MTP layer 4 the test writes itself under its own name table (random
weights, norm gains in [0.5, 1.5), the release's ``embed_tokens`` and ``shared_head.head`` copies
too): an oracle independent of checkpoint/hf_moe.py's table. Then, through the runtime on one rank
and under ep2·pp2 (MTP on the last stage): import → step 1 → export → step 2; the export imported
in the same layout holds every parameter bit for bit, and its step 2 gives the same loss and
mtp_loss as the exporting run's."""
from __future__ import annotations

import json
import os

import pytest
import torch

from paralayer.checkpoint import hf as hfmod
from paralayer.checkpoint import hf_moe
from paralayer.config.schema import ModelConfig
from paralayer.families import HFFormatError, apply_hf_config
from paralayer.families.names import ours_to_hf
from paralayer.model.transformer import Transformer
from tests.families import widen
from tests.test_hf_deepseek import CFG, SEQ, VOCAB
from tests.test_hf_deepseek import _ours as deepseek_ours

N = CFG["num_hidden_layers"]  # the MTP depth's layer: model.layers.4
#: the test's own reading of DeepSeek's MTP naming (not hf_moe's table): our name → key
OWN = {"mtp.layers.0.enorm.weight": f"model.layers.{N}.enorm.weight",
       "mtp.layers.0.hnorm.weight": f"model.layers.{N}.hnorm.weight",
       "mtp.layers.0.eh_proj.weight": f"model.layers.{N}.eh_proj.weight",
       "mtp.layers.0.norm.weight": f"model.layers.{N}.shared_head.norm.weight"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An HF deepseek_v3 directory with one MTP depth (num_nextn_predict_layers 1) at layer N."""
    import transformers
    from safetensors.torch import load_file, save_file

    path = str(tmp_path_factory.mktemp("dsv3mtp") / "src")
    model = widen(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CFG)), 1).float()
    model.save_pretrained(path)
    st = os.path.join(path, "model.safetensors")
    t = load_file(st)
    g = torch.Generator().manual_seed(21)
    for key in [k for k in t if k.startswith(f"model.layers.{N - 1}.")]:  # a full MoE decoder layer
        v = t[key]
        new = key.replace(f"model.layers.{N - 1}.", f"model.layers.{N}.")
        if key.endswith("norm.weight"):
            t[new] = torch.rand(v.shape, generator=g) + 0.5
        elif key.endswith("e_score_correction_bias"):
            t[new] = torch.randn(v.shape, generator=g) * 0.1
        else:
            t[new] = torch.randn(v.shape, generator=g) * 0.2
    d = CFG["hidden_size"]
    for name, key in OWN.items():
        shape = (d, 2 * d) if "eh_proj" in key else (d,)
        t[key] = torch.randn(shape, generator=g) * 0.2 if "eh_proj" in key else torch.rand(shape, generator=g) + 0.5
    t[f"model.layers.{N}.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()  # the release's copies
    t[f"model.layers.{N}.shared_head.head.weight"] = t["lm_head.weight"].clone()
    save_file(t, st, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    return path, t


def _ours(path: str, depth: int, seed: int = 0):
    return deepseek_ours(path, mtp_depth=depth, init_std=0.2, seed=seed)


def _mtp_mismatches(model, t: dict) -> list:
    """MTP parameters of ``model`` that differ from the checkpoint's: its own parts by the test's
    table OWN, the block's weights as decoder layer N's (experts stacked, rope rows reordered)."""
    bad = []
    nope, rope, rank = CFG["qk_nope_head_dim"], CFG["qk_rope_head_dim"], CFG["kv_lora_rank"]
    rows = {"attention.q_b.weight": (nope, rope, nope + rope), "attention.wq.weight": (nope, rope, nope + rope),
            "attention.kv_a.weight": (rank, rope, rank + rope)}  # DeepSeek's interleaved rope rows
    for name, p in model.named_parameters():
        if not name.startswith("mtp.layers.0."):
            continue
        if name in OWN:
            want = t[OWN[name]]
        else:
            inner = f"layers.{N}." + name[len("mtp.layers.0.block."):]
            if inner.split(".")[-1] in ("w1", "w2", "w3"):
                want = torch.stack([t[ours_to_hf(inner, expert=j, family="deepseek_v3")]
                                    for j in range(p.shape[0])])
            else:
                want = hfmod._deinterleave_rope(t[ours_to_hf(inner, family="deepseek_v3")], inner, rows)
        if not torch.equal(p.detach(), want):
            bad.append(name)
    return bad


def test_one_rank_reads_every_mtp_weight(source):
    path, t = source
    model, mcfg = _ours(path, 1)
    names = [n for n, _ in model.named_parameters() if n.startswith("mtp.")]
    assert len(names) > 10 and not _mtp_mismatches(model, t)
    bias = model.mtp.layers["0"].block.feed_forward.expert_bias
    assert torch.equal(bias, t[f"model.layers.{N}.mlp.gate.e_score_correction_bias"])  # the MTP router's bias too


def test_planted_enorm_hnorm_swap_fails(source, monkeypatch):
    path, t = source
    swapped = dict(hf_moe._MTP_PARTS, **{"enorm.weight": "hnorm.weight", "hnorm.weight": "enorm.weight"})
    monkeypatch.setattr(hf_moe, "_MTP_PARTS", swapped)
    model, _ = _ours(path, 1)
    assert sorted(_mtp_mismatches(model, t)) == ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight"]


def test_depth_0_ignores_mtp_and_missing_depth_starts_fresh(source, capfd):
    from paralayer.model.transformer import init_weights

    path, t = source
    model, _ = _ours(path, 0)  # the MTP layer is there but not wanted
    assert getattr(model, "mtp", None) is None
    assert "carries 1 MTP depth(s)" in capfd.readouterr().err
    model, mcfg = _ours(path, 2, seed=5)  # depth 1 read, depth 2 (absent) from the init of seed 5
    assert "depths 1..1 start from a fresh init" in capfd.readouterr().err
    assert not _mtp_mismatches(model, t)
    fresh = Transformer(mcfg)
    init_weights(fresh, mcfg, 5)
    want = dict(fresh.named_parameters())
    layer1 = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.layers.1.")]
    assert layer1 and all(torch.equal(p, want[n]) for n, p in layer1)
    assert not torch.equal(model.mtp.layers["1"].eh_proj.weight, model.mtp.layers["0"].eh_proj.weight)


def test_bad_num_nextn_predict_layers_is_refused(source, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(source[0], bad)
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["num_nextn_predict_layers"] = -1
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(HFFormatError, match="num_nextn_predict_layers"):
        apply_hf_config(ModelConfig(), bad)


def _overrides(path: str, data: str, layout: list) -> list:
    return ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"model.init=hf:{path}", f"model.seq_len={SEQ}",
            f"data.path={data}", "data.format=tokens", "data.shuffle=false", "train.global_batch=4",
            "train.micro_batch=1", "train.steps=2", "train.precision=fp32", "train.grad_clip=1e9",
            "model.moe.aux_loss_coef=0", "train.threads=1", "logging.wandb.mode=disabled", "model.init_std=0.2",
            "model.mtp.depth=1", "model.mtp.loss_weight=0.3"] + list(layout)


def _local(chunks) -> dict:
    from torch.distributed.tensor import DTensor

    from paralayer.model.transformer import _clean_name

    return {_clean_name(n): (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for c in chunks for n, p in c.named_parameters()}


def _export_import_worker(rank, world, src, data, layout, out):
    """Import src → step 1 → export → step 2; then import the export in the same layout and run its
    step 2. Returns (exporting step 2 record, re-imported step 2 record, names not bit-equal, names)."""
    from paralayer.checkpoint.hf import export_hf
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import setup, train_step
    from tests.dist import cfg_and_plan

    cfg, plan = cfg_and_plan(_overrides(src, data, layout))
    run = setup(cfg, as_plan(plan), None)
    train_step(run, 1)
    export_hf(run.built.chunks, cfg.model, out)
    held = _local(run.built.chunks)
    a = train_step(run, 2)
    cfg_b, plan_b = cfg_and_plan(_overrides(out, data, layout))
    run_b = setup(cfg_b, as_plan(plan_b), None)
    back = _local(run_b.built.chunks)
    b = train_step(run_b, 2)
    unequal = sorted(n for n in held if n not in back or not torch.equal(held[n], back[n]))
    return ({k: a[k] for k in ("loss", "mtp_loss")}, {k: b[k] for k in ("loss", "mtp_loss")}, unequal, sorted(held))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.dist import write_tokens

    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 8, SEQ, VOCAB)


@pytest.mark.parametrize("layout,world", [
    ("one", 1), ("ep2_pp2", 4)])
def test_export_then_import_is_exact(source, tokens, tmp_path, layout, world):
    from tests.dist import run_ranks

    extra = [] if layout == "one" else ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.schedule=1f1b",
                                        "parallel.pp_layout=[3,1]"]
    out = str(tmp_path / "export")
    res = run_ranks(_export_import_worker, world, source[0], tokens, extra, out, timeout_s=400)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert set(OWN.values()) <= keys and f"model.layers.{N}.mlp.experts.7.down_proj.weight" in keys
    names = set().union(*(set(r[3]) for r in res))
    assert any(n.startswith("mtp.layers.0.block.") for n in names) and "mtp.layers.0.enorm.weight" in names
    assert ("mtp.embed.weight" in names) == (layout != "one")  # the last stage's embedding copy under pp
    assert not [r[2] for r in res if r[2]], [r[2] for r in res]  # every rank's parameters, bit for bit
    for a, b, _, _ in res:
        print(f"{layout}: exporting step 2 {a}, re-imported step 2 {b}")
        assert a["mtp_loss"] > 0 and a == b, (a, b)
