"""Exports judged against the trained model (issue 46 item 3), for every family of
paralayer/families/registry.py, under one rank, tp2, pp2 and (MoE families) ep2.

Each family's source is transformers' own class saved by its own ``save_pretrained`` (the tiny
models of tests/families.py, test_hf_moe.py, test_hf_deepseek.py, test_hf.py; one folder per
family for the module). The run imports it (``model.init=hf:``), trains 2 steps, computes its own
loss on the next batch (step 3's global batch, no update) and exports. transformers loads the
export with the family's own class and its loss on that batch must equal the trained model's
within 1e-5 relative: an oracle outside our code (a re-import of our own export would agree
with it by construction). The planted error: the export's ``num_experts_per_tok`` off by one
(top_k + 1) must move transformers' loss past 100x the tolerance for every MoE family."""
from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from paralayer.families.registry import FAMILIES
from tests.dist import cfg_and_plan, run_ranks, write_tokens

SEQ, VOCAB, BATCH, TOL = 32, 61, 4, 1e-5
MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe_text")
LAYOUTS = {"one": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "parallel.schedule=1f1b"],
           "ep2": ["parallel.dp=2", "parallel.ep=2"]}
CASES = [(f, lay) for f in FAMILIES for lay in LAYOUTS if lay != "ep2" or f in MOE]


def _save(family: str, path: str) -> None:
    """transformers' tiny model of ``family`` (fp32, wide init) saved into ``path``."""
    from tests import families as fam

    if family in ("llama", "mistral", "qwen3", "gemma3_text", "gpt_oss"):
        fam.save_family({"llama": "llama3", "gemma3_text": "gemma3"}.get(family, family), path)
    elif family == "qwen3_next":
        from tests.qwen3_next_ref import save as save_qwen3_next

        save_qwen3_next(path)
    elif family in ("qwen3_5_text", "qwen3_5_moe_text"):
        from tests.test_qwen3_5 import save as save_qwen3_5

        # the dense one with tied embeddings (Qwen3.5's small sizes tie): its export ties them too; untied,
        # its two steps moved the loss by 8.8e-4 only, under the 100x check below
        dense = family == "qwen3_5_text"
        save_qwen3_5(path, "dense" if dense else "moe", **({"tie_word_embeddings": True} if dense else {}))
    elif family == "qwen3_moe":
        from tests.test_hf_moe import _save as save_qwen3_moe

        save_qwen3_moe(path)
    elif family == "deepseek_v3":
        from tests.test_hf_deepseek import CFG, save_deepseek

        save_deepseek(path, CFG, 1, 9)
    elif family == "mixtral":
        from tests.test_hf import _save_mixtral

        _save_mixtral(path)
    else:
        raise AssertionError(f"family {family!r} has no tiny source here: add one")


def micro_batch(layout: list) -> int:
    """One forward and backward a step on each rank where the layout allows it: the whole batch on
    one rank or tp, half of it on each of dp's 2 ranks (ep2); micro batch 1 under pp, whose schedule
    keeps its 4 micro-batches. A quarter (half under ep2) of micro batch 1's passes, and so of tp's
    collectives; the step's gradient is the same mean over the global batch, and the export reads
    the weights whatever the accumulation was."""
    if any(o.startswith("parallel.pp=") for o in layout):
        return 1
    return BATCH // 2 if any(o.startswith("parallel.dp=") for o in layout) else BATCH


def _overrides(path: str, data: str, layout: list) -> list:
    return ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"model.init=hf:{path}", f"model.seq_len={SEQ}",
            f"data.path={data}", "data.format=tokens", "data.shuffle=false", f"train.global_batch={BATCH}",
            f"train.micro_batch={micro_batch(layout)}", "train.steps=3", "train.precision=fp32", "train.threads=1",
            "logging.wandb.mode=disabled"] + list(layout)


def _train_worker(rank, world, runs):
    """For each (config, plan, out dir): 2 training steps from the import, the model's own global loss
    on step 3's batch (forward and backward, no update), then export_hf (collective). The configs are
    loaded in the test process, once a case, not once a rank (~0.3 CPU-s each)."""
    from paralayer.checkpoint.hf import export_hf
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import forward_backward, reduce_and_clip_tensors, setup, step_batch, train_step

    out = []
    for cfg, plan, folder in runs:
        run = setup(cfg, as_plan(plan), None)
        trained = [train_step(run, s)["loss"] for s in (1, 2)]
        run.opt.zero_grad(set_to_none=True)
        tokens, labels = step_batch(run, 3)
        loss, _ = reduce_and_clip_tensors(run, forward_backward(run, tokens, labels))
        export_hf(run.built.chunks, cfg.model, folder)
        out.append((trained, float(loss)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{(family, layout): (export folder, the trained model's loss on step 3's batch)}: one 1-rank
    and one 2-rank world, every family in turn in each."""
    root = tmp_path_factory.mktemp("export_trained")
    tokens = write_tokens(str(root / "t.jsonl"), 3 * BATCH, SEQ, VOCAB)
    src = {}
    for f in FAMILIES:
        src[f] = str(root / "src" / f)
        _save(f, src[f])
    out = {}
    for world, lays in ((1, ["one"]), (2, ["tp2", "pp2", "ep2"])):
        cases = [(f, lay) for f, lay in CASES if lay in lays]
        runs = [(*cfg_and_plan(_overrides(src[f], tokens, LAYOUTS[lay])), str(root / "out" / f"{f}-{lay}"))
                for f, lay in cases]
        res = run_ranks(_train_worker, world, runs, timeout_s=600)
        for i, case in enumerate(cases):
            losses = [r[i][1] for r in res]
            assert max(losses) - min(losses) <= 1e-6 * abs(losses[0]), (case, losses)  # one global loss
            out[case] = (runs[i][2], losses[0], src[case[0]])
    out["tokens"] = tokens
    return out


def hf_loss(folder: str, tokens: str) -> tuple[float, str]:
    """transformers' loss on step 3's global batch of the export in ``folder``, and its class."""
    import transformers

    rows = [json.loads(line)["input_ids"] for line in open(tokens)]
    x = torch.tensor(rows[2 * BATCH:3 * BATCH])
    with open(os.path.join(folder, "config.json")) as f:  # GPT-OSS's sinks: transformers' eager attention only
        impl = "eager" if json.load(f)["model_type"] == "gpt_oss" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=impl).float().eval()
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss), type(model).__name__


@functools.lru_cache(maxsize=None)
def source_loss(src: str, tokens: str) -> float:
    """transformers' loss of the untrained source on step 3's batch: once per family (every layout
    of the family compares against the same figure)."""
    return hf_loss(src, tokens)[0]


def plant_top_k_plus_one(folder: str, dst: str) -> str:
    """A copy of the export whose config.json routes each token to one expert more."""
    shutil.copytree(folder, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["num_experts_per_tok"] += 1
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_export_gives_the_trained_models_loss(results, family, layout, tmp_path):
    folder, ours, src = results[(family, layout)]
    got, cls = hf_loss(folder, results["tokens"])
    before = source_loss(src, results["tokens"])
    err = abs(got - ours) / abs(ours)
    print(f"{family} {layout}: trained loss {ours:.6f}, transformers on the export {got:.6f} (rel err {err:.1e}); "
          f"the untrained source {before:.6f}")
    assert cls == FAMILIES[family].HF_CLASS, cls
    assert abs(before - ours) / abs(ours) > 100 * TOL, (before, ours)  # the two steps trained
    assert err < TOL, (family, layout, got, ours)
    if family in MOE and layout == "one":
        bad, _ = hf_loss(plant_top_k_plus_one(folder, str(tmp_path / "planted")), results["tokens"])
        print(f"{family} {layout} planted top_k + 1: transformers {bad:.6f} (rel err {abs(bad - ours) / ours:.1e})")
        assert abs(bad - ours) / abs(ours) > 100 * TOL, (family, layout, bad, ours)
