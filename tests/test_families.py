"""The families against transformers' own classes (issue #33): Llama with Llama 3.1's RoPE,
Qwen3 (head_dim != d_model / n_heads, per-head q/k norms), Qwen3 with interleaved sliding and
full layers, Mistral with a uniform window, Gemma 3 (issue #47: scaled embedding, (1 + w) norms
before and after attention and MLP, GeGLU, query_pre_attn_scalar, a RoPE per layer type) — each
saved by its own ``save_pretrained``
(tests/families.py), imported by ``model.init=hf:DIR``.

- one rank: logits and every parameter's gradient within 1e-5 relative; each planted error
  (q/k norm after RoPE, RoPE factor ×2, window off by one; Gemma: the embedding scale dropped,
  the sliding layers on the global RoPE, the post norms dropped) moves them past 100× the tolerance;
- tp2 (+SP), pp2 (1f1b and zbv), cp2, dp2·ZeRO-3, through the runtime (setup, the step's forward
  and backward, the gradient reduction): the global batch's loss and every full gradient against
  transformers' on the same batch: loss 1e-5, every gradient 1e-4 relative (the issue's bounds);
- both spellings of the RoPE in config.json read the same; what we cannot build is refused;
- round trip: import → 2 training steps → export; transformers loads the export and its logits
  equal ours within 1e-6."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paralayer.checkpoint.hf import load_hf_weights
from paralayer.config import ModelConfig
from paralayer.families import apply_hf_config, load_hf_config
from paralayer.families.names import ours_to_hf
from paralayer.model.transformer import Transformer
from tests import families as fam
from tests.dist import run_ranks, write_tokens

TOL = 1e-5
#: every gradient under a layout: the issue's acceptance bound, 1e-4 relative. The runtime's sums run in
#: another order than transformers' one process (cp's chunks, tp's partial sums, dp's halves), and fp32
#: kernels differ by machine: on an AVX-512 EPYC (7 Dec) gemma3 cp2 read 1.1e-5 (wq), gpt_oss cp2 1.1e-5
#: (sinks), the others 2e-6 to 7e-6. GPT-OSS's router bias: softmax over the k chosen logits is
#: shift-invariant, so its gradient sums to 0 over the experts and each entry is a difference of
#: per-token terms (2.3e-5 between transformers' order of sums and ours). The plants still move a
#: gradient past 100 x TOL (0.73 and 1.5).
LAYOUT_GRAD_TOL = 1e-4
# Qwen3's q/k norm names are written here, not taken from our map
_LITERAL = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight",
            "attention.wq.weight": "self_attn.q_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight"}
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2_1f1b": ["parallel.pp=2", "parallel.schedule=1f1b"],
           "pp2_zbv": ["parallel.pp=2", "parallel.schedule=zbv"], "cp2": ["parallel.cp=2"],
           "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"], "ep2": ["parallel.dp=2", "parallel.ep=2"]}
#: the layouts only some families run (ep: the MoE ones)
ONLY = {"ep2": ("gpt_oss",)}
CASES = [(f, lay) for lay in LAYOUTS for f in ONLY.get(lay, fam.FAMILIES)]
BATCH = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (directory, the transformers model)} (each saved once per module)."""
    root = tmp_path_factory.mktemp("families")
    return {f: (str(root / f), fam.save_family(f, str(root / f))) for f in fam.FAMILIES}


def _rel(got, want) -> float:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _ours(path: str, plant: str | None = None):
    mcfg = ModelConfig()
    apply_hf_config(mcfg, path)
    if plant in fam.CONFIG_PLANTS:
        fam.plant(None, mcfg, plant)
    with torch.device("meta"):
        model = Transformer(mcfg)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, mcfg)
    if plant in ("qk_norm_after_rope", "sink_left_out"):
        fam.plant(model, mcfg, plant)
    return model, mcfg


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, fam.VOCAB, (2, fam.SEQ), generator=g)


def _hf_name(family: str):
    """our name → the transformers key in ``family``'s naming (Gemma names its norms its own way)."""
    return lambda n: ours_to_hf(n, family=fam.HF_FAMILY[family])


def _oracle(ref, model, family: str) -> tuple[float, dict]:
    """(logits rel err, {our name: grad rel err}) for the mean next-token CE of one batch."""
    x = _batch()
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=x, labels=x)
    out.loss.backward()
    got = model(x)
    F.cross_entropy(got[:, :-1].reshape(-1, fam.VOCAB), x[:, 1:].reshape(-1)).backward()
    hf = dict(ref.named_parameters())
    return _rel(got.detach(), out.logits.detach()), {n: _rel(p.grad, fam.their_grad(hf, family, n))
                                                     for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", fam.FAMILIES)
def test_one_rank_matches_transformers_and_plants_fail(saved, family):
    path, ref = saved[family]
    model, mcfg = _ours(path)
    names = {n for n, _ in model.named_parameters()}
    if family in ("qwen3", "window"):
        assert mcfg.qk_norm and mcfg.head_dim == 24 and "layers.0.attention.q_norm.weight" in names
    for ours, hf in _LITERAL.items():
        if f"layers.1.{ours}" in names:
            assert ours_to_hf(f"layers.1.{ours}") == f"model.layers.1.{hf}"
    logits_err, grads = _oracle(ref, model, family)
    print(f"{family}: logits rel err {logits_err:.1e}, grads max {max(grads.values()):.1e} over {len(grads)}")
    assert logits_err < TOL and max(grads.values()) < TOL, (logits_err, grads)
    for plant in fam.PLANTS[family]:
        bad, _ = _ours(path, plant)
        e, g = _oracle(ref, bad, family)
        print(f"{family} planted {plant}: logits rel err {e:.1e}, grads max {max(g.values()):.1e}")
        assert e > 100 * TOL and max(g.values()) > 100 * TOL, (plant, e)


def test_config_fields_and_both_rope_spellings(saved, tmp_path):
    c = load_hf_config(saved["window"][0])
    assert c["layer_types"] == ["sliding", "full", "sliding", "full"] and c["sliding_window"] == fam.WINDOW
    assert c["head_dim"] == 24 and c["qk_norm"] is True
    assert c["rope"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position": 32}
    m = load_hf_config(saved["mistral"][0])
    assert m["sliding_window"] == fam.WINDOW and m["layer_types"] is None and not m["qk_norm"]
    assert m["rope"]["type"] == "yarn" and m["rope"]["factor"] == 2.0
    # transformers 4's spelling: rope_scaling (+ rope_theta at the top) reads the same
    src = json.load(open(os.path.join(saved["llama3"][0], "config.json")))
    old = {k: v for k, v in src.items() if k != "rope_parameters"}
    old["rope_theta"] = fam.THETA
    old["rope_scaling"] = {k: v for k, v in fam.LLAMA3.items() if k != "rope_theta"}
    os.makedirs(tmp_path / "old")
    json.dump(old, open(tmp_path / "old" / "config.json", "w"))
    assert load_hf_config(str(tmp_path / "old")) == load_hf_config(saved["llama3"][0])


@pytest.mark.parametrize("edit, words", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type=\"longrope\""),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "factor is missing (rope_type linear"),
    ({"model_type": "gemma3"}, "model_type=\"gemma3\" is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ({"rope_parameters": {**fam.YARN, "truncate": "no"}}, 'truncate="no" is not supported (true or false)'),
    ({"head_dim": 23}, "head_dim=23 must be even"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
])
def test_what_we_cannot_build_is_refused(saved, tmp_path, edit, words):
    cfg = json.load(open(os.path.join(saved["qwen3"][0], "config.json")))
    cfg.update(edit)
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError) as exc:
        load_hf_config(str(tmp_path))
    assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


# ------------------------------------------------------------------ multi-rank, through the runtime
def micro_batch(layout: list) -> int:
    """2 micro-batches a step on every rank (the gradient accumulated over them): micro batch 1 where
    the batch is split (pp's schedules keep their 4 micro-batches, dp halves the batch), else 2 (one
    rank, tp and cp: half the passes, and so half the collectives, of micro batch 1)."""
    return 1 if any(o.startswith(("parallel.pp=", "parallel.dp=")) for o in layout) else 2


def _overrides(path: str, data: str, layout: list) -> list:
    return ["recipe=tiny", "parallel.tp=1", "parallel.dp=1", f"model.init=hf:{path}", f"model.seq_len={fam.SEQ}",
            f"data.path={data}", "data.format=tokens", "data.shuffle=false", f"train.global_batch={BATCH}",
            f"train.micro_batch={micro_batch(layout)}", "train.steps=2", "train.precision=fp32", "train.grad_clip=1e9",
            "logging.wandb.mode=disabled"] + list(layout)


def _grads_worker(rank, world, runs):
    """For each overrides of ``runs``, the runtime's step 1 on this rank: the global loss and this
    rank's full gradients (every run in this one forked world: one start-up for all families)."""
    from torch.distributed.tensor import DTensor

    from paralayer.model.transformer import _clean_name
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import forward_backward, reduce_and_clip_tensors, setup, step_batch
    from tests.dist import cfg_and_plan

    out = []
    for overrides in runs:
        cfg, plan = cfg_and_plan(overrides)
        run = setup(cfg, as_plan(plan), None)
        tokens, labels = step_batch(run, 1)
        loss, _ = reduce_and_clip_tensors(run, forward_backward(run, tokens, labels))
        grads = {}
        for chunk in run.built.chunks:
            for n, p in chunk.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                name = _clean_name(n)
                head = name in ("tok_embeddings.weight", "output.weight")
                grads[name] = (g[: fam.VOCAB] if head else g).numpy().copy()
        out.append((float(loss), grads))
    return out


#: planted into a copy of the window family's checkpoint (its config.json edited), run under cp2:
#: the window ring and the zigzag positions must not hide them
CP_PLANTS = {"window_off_by_one": lambda c: c.update(sliding_window=c["sliding_window"] + 1),
             "rope_factor_x2": lambda c: c["rope_parameters"].update(factor=c["rope_parameters"]["factor"] * 2)}


def _planted_copy(src: str, dst: str, edit) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    edit(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def layout_results(saved, tokens, tmp_path_factory):
    """{(family, layout): [(loss, grads) per rank]}: one 2-rank world per layout, the families in turn
    (cp2 also runs the planted copies, keyed ("window", "cp2", plant))."""
    root = tmp_path_factory.mktemp("planted")
    planted = {k: _planted_copy(saved["window"][0], str(root / k), e) for k, e in CP_PLANTS.items()}
    out = {}
    for layout, extra in LAYOUTS.items():
        fams = ONLY.get(layout, fam.FAMILIES)
        keys = [(f, layout) for f in fams]
        paths = [saved[f][0] for f in fams]
        if layout == "cp2":
            keys += [("window", layout, k) for k in planted]
            paths += list(planted.values())
        res = run_ranks(_grads_worker, 2, [_overrides(p, tokens, extra) for p in paths], timeout_s=300)
        for i, key in enumerate(keys):
            out[key] = [r[i] for r in res]
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 2 * BATCH, fam.SEQ, fam.VOCAB)


@pytest.fixture(scope="module")
def hf_reference(saved, tokens):
    """{family: (transformers' loss, {its name: its gradient})} on the global batch: one forward and
    backward per family, read by every layout of that family (the gradients copied out of the shared
    model, which other tests zero)."""
    from types import SimpleNamespace

    x = torch.tensor([json.loads(line)["input_ids"] for line in open(tokens)][:BATCH])
    out = {}
    for family in fam.FAMILIES:
        ref = saved[family][1]
        ref.zero_grad(set_to_none=True)
        res = ref(input_ids=x, labels=x)
        res.loss.backward()
        out[family] = (res.loss.item(), {n: SimpleNamespace(grad=None if p.grad is None else p.grad.clone())
                                         for n, p in ref.named_parameters()})
        ref.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family, layout", CASES)
def test_layouts_match_transformers(hf_reference, layout_results, family, layout):
    want_loss, hf = hf_reference[family]
    loss_err, errs = _layout_errors(layout_results[(family, layout)], want_loss, hf, family)
    print(f"{family} {layout}: loss rel err {loss_err:.1e}, grads max {max(errs.values()):.1e} "
          f"({max(errs, key=errs.get)}) over {len(errs)}")
    assert loss_err < TOL and max(errs.values()) < LAYOUT_GRAD_TOL, errs
    if (family, layout) == ("window", "cp2"):
        for plant in CP_PLANTS:
            p_loss, p_errs = _layout_errors(layout_results[(family, layout, plant)], want_loss, hf, family)
            print(f"window cp2 planted {plant}: loss rel err {p_loss:.1e}, grads max {max(p_errs.values()):.1e}")
            assert max(p_errs.values()) > 100 * TOL, (plant, p_errs)


def _layout_errors(res, want_loss: float, hf: dict, family: str) -> tuple[float, dict]:
    """(loss rel err, {our name: grad rel err}) of the ranks' results against transformers'."""
    parts: dict = {}
    for _, g in res:
        for n, t in g.items():
            parts.setdefault(n, []).append(t)
    fused = 2 * sum(1 for k in hf if k.endswith("mlp.experts.gate_up_proj"))  # GPT-OSS: 4 tensors are our 6
    assert len(parts) == len(hf) + fused, (sorted(parts), len(hf))
    errs = {}
    for n, ts in parts.items():
        want = fam.their_grad(hf, family, n)
        # under ep each rank holds its experts' rows (rank order = expert order); else any copy
        got = torch.from_numpy(ts[-1] if ts[-1].shape == tuple(want.shape) else np.concatenate(ts))
        errs[n] = _rel(got, want)
    return max(abs(r[0] - want_loss) / want_loss for r in res), errs


# ------------------------------------------------------------------ round trip: import → 2 steps → export
def _round_trip_worker(rank, world, runs):
    """For each (overrides, out dir): 2 training steps from the import, then export_hf (collective)."""
    from paralayer.checkpoint.hf import export_hf
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import setup, train_step
    from tests.dist import cfg_and_plan

    losses = []
    for overrides, out in runs:
        cfg, plan = cfg_and_plan(overrides)
        run = setup(cfg, as_plan(plan), None)
        losses.append([train_step(run, s)["loss"] for s in (1, 2)])
        export_hf(run.built.chunks, cfg.model, out)
    return losses


LR = 3e-3  # the tiny recipe's train.lr
ROUND_TRIP = {"one": [], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "parallel.schedule=1f1b"]}


def test_round_trip_through_training_and_export(saved, tokens, tmp_path):
    """transformers loads each export (its own class for the family) and its logits equal ours
    within 1e-6; the tp2 and pp2 exports equal the one-rank export (the heads and the layers are
    split and merged back right)."""
    import transformers
    from safetensors.torch import load_file

    outs = {}
    for lay, extra in ROUND_TRIP.items():
        runs = [(_overrides(saved[f][0], tokens, extra), str(tmp_path / f"{f}-{lay}")) for f in fam.FAMILIES]
        run_ranks(_round_trip_worker, 1 if lay == "one" else 2, runs, timeout_s=300)
        outs[lay] = {f: r[1] for f, r in zip(fam.FAMILIES, runs)}
    x = torch.tensor([json.loads(line)["input_ids"] for line in open(tokens)][:2])
    want_class = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "window": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
    for f in fam.FAMILIES:
        one = outs["one"][f]
        back = transformers.AutoModelForCausalLM.from_pretrained(one, attn_implementation=fam.attn_impl(f))
        back = back.float().eval()
        assert type(back).__name__ == want_class[f]
        ours, mcfg = _ours(one)
        with torch.no_grad():
            got, theirs = ours(x), back(input_ids=x, labels=x)
            err = _rel(got, theirs.logits)
            loss = F.cross_entropy(got[:, :-1].reshape(-1, fam.VOCAB), x[:, 1:].reshape(-1)).item()
        src = json.load(open(os.path.join(saved[f][0], "config.json")))
        exp = json.load(open(os.path.join(one, "config.json")))
        for key in ("rope_parameters", "head_dim", "sliding_window", "layer_types"):
            if key in src:
                assert exp.get(key) == src[key] or (key == "head_dim" and src[key] is None), (f, key)
        print(f"{f}: exported logits vs transformers' from_pretrained rel err {err:.1e}, loss {loss:.7f} vs "
              f"{theirs.loss.item():.7f}")
        # GPT-OSS: transformers' eager softmax with a sink column vs our flash kernel with the sink in
        # the lse: 2.9e-6 on the logits, the loss equal to 1e-7
        assert err < (TOL if f == "gpt_oss" else 1e-6), (f, err)
        assert abs(loss - theirs.loss.item()) < 1e-6 * theirs.loss.item(), (f, loss, theirs.loss.item())
        ref = load_file(os.path.join(one, "model.safetensors"))
        src_w = load_file(os.path.join(saved[f][0], "model.safetensors"))
        for lay in ("tp2", "pp2"):
            got = load_file(os.path.join(outs[lay][f], "model.safetensors"))
            assert set(got) == set(ref), (f, lay)
            diffs = {k: (got[k] - ref[k]).abs().max().item() for k in ref}
            worst = max(diffs, key=diffs.get)
            print(f"{f} {lay}: largest |export - one-rank export| {diffs[worst]:.1e} ({worst})")
            # Adam moves an element by at most ~lr a step whatever its gradient, so gradients equal to
            # 1e-6 can still part by up to 2·lr per step where a gradient is ~0; a head or layer put
            # in the wrong place moves weights by ~0.2 (init std)
            assert diffs[worst] < 4 * LR, (f, lay, worst, diffs[worst])
        moved = max((ref[k] - src_w[k]).abs().max().item() for k in ref if k in src_w)
        assert moved > 1e-4, moved  # the two steps trained


@pytest.mark.parametrize("edit, words", [
    ({"model_type": "olmo3"}, 'model_type="olmo3" is not supported (llama, mistral, mixtral, qwen3, qwen3_moe, '
                              'deepseek_v3, gemma3_text, gpt_oss, qwen3_next, qwen3_5_text, '
                              'qwen3_5_moe_text)'),
    ({"model_type": "gemma4_text"}, 'model_type="gemma4_text" is not supported (Gemma 4 (per-layer input'),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     'rope_parameters.rope_type="dynamic" is not supported (default, linear, llama3, yarn)'),
])
def test_front_door_refuses_in_one_line_and_writes_nothing(saved, tmp_path, capsys, edit, words):
    from paralayer.cli import main

    cfg = json.load(open(os.path.join(saved["qwen3"][0], "config.json")))
    cfg.update(edit)
    os.makedirs(tmp_path / "hf")
    json.dump(cfg, open(tmp_path / "hf" / "config.json", "w"))
    rc = main(["recipe=tiny", f"model.init=hf:{tmp_path / 'hf'}", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "model.init:" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
