"""Qwen3.5 (issue #47 items 1 and 6: paralayer/families/qwen3_5/, checkpoint/hf_split.py) against
transformers 5.25's own Qwen3_5ForCausalLM (dense) and Qwen3_5MoeForCausalLM, at init std 0.2, each
with tests/qwen3_next_ref.py's shape (linear, full, linear, full; 2 k-heads serving 4 v-heads; MoE:
4 experts top-2 with the gated shared expert) and the multimodal RoPE sections [2, 1, 1] interleaved:

- one rank: logits within 1e-5 and every gradient within 1e-4 relative, for both; planted errors move
  them past 100× those: in_proj_z's rows taken in the wrong k-head's order on import, and the
  multimodal RoPE mis-reduced (a text token's H and W rows taken as 0, not its position);
- the vision-language wrapper (Qwen3_5ForConditionalGeneration, tied embeddings): its own text-only
  forward (its 3-D positions) equals ours from its checkpoint, the vision tower said unread in a line,
  and under tp2 (each rank reading its slices through the prefix) loss and gradients equal its own;
- tp2, pp2, cp2, dp2·ZeRO-3 and (MoE) ep2 through the runtime's step: loss within 1e-5, every gradient
  within 1e-4 of transformers' on the same global batch (all in one forked 2-rank world, with:)
- round trips: import, 2 steps (dense under tp2, MoE under ep2), export; transformers loads the
  export as its text class, and its loss on the next batch equals our runtime's step-3 loss;
- what the classes would not build as asked is refused by name; the readers' defaults are the classes'."""
from __future__ import annotations

import json
import os

import pytest
import torch

from paralayer.checkpoint import hf_split
from paralayer.families import HFFormatError, load_hf_config
from paralayer.families.qwen3_5.text_config import TEXT_PREFIX
from tests import qwen3_next_ref as q
from tests.families import VOCAB, widen
from tests.qwen3_next_ref import SEQ
from tests.test_qwen3_next import _oracle as next_oracle
from tests.test_qwen3_next import _ours, _overrides, _rel, hf_grad

LOGITS_TOL, GRAD_TOL, BATCH = 1e-5, 1e-4, 4
MROPE = {"mrope_section": [2, 1, 1], "mrope_interleaved": True}  # 4 frequency pairs: head 16 × 0.5 / 2
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def text_config(kind: str, **kw) -> dict:
    """Qwen3-Next's tiny shape as a Qwen3.5 text config (dense: no expert keys; MoE: no
    intermediate_size, a key its class dropped)."""
    c = {k: v for k, v in q.CONFIG.items() if k != "full_attention_interval"}
    c.update(layer_types=["linear_attention", "full_attention"] * 2,
             rope_parameters={**c["rope_parameters"], **MROPE}, **kw)
    drop = _MOE_KEYS if kind == "dense" else ("intermediate_size",)
    return {k: v for k, v in c.items() if k not in drop}


def _widened(model, seed: int):
    """widen's std 0.2, the (1 + w) norms' gains in [0.5, 1.5) (as tests/qwen3_next_ref.py)."""
    model = widen(model.float().eval(), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name and "visual" not in name:
                p.sub_(1.0)
    return model


def save(path: str, kind: str, **kw):
    """transformers' Qwen3.5 text model of ``kind`` (dense | moe; ``kw``: config keys), saved by its own
    save_pretrained; widen's draw 11, tests/qwen3_next_ref.py's. (Draw 12 put the MoE model's layer-2
    in_proj gradient on the fp32 floor: transformers' own fp32 gradient parted from its fp64 one by
    1.4e-4, ours under cp2 from that fp64 one by 2.8e-5, so ours against its fp32 read 1.3e-4.)"""
    import transformers

    torch.manual_seed(0)
    if kind == "dense":
        cfg = transformers.Qwen3_5TextConfig(**text_config(kind, **kw))
        model = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**text_config(kind, **kw))
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    cfg._attn_implementation = "sdpa"
    model = _widened(model, 11)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {k: (str(root / k), save(str(root / k), k)) for k in ("dense", "moe")}


class _Grads:
    """transformers' gradients as a checkpoint reader (hf_split.read_split reads them as ours)."""

    def __init__(self, params: dict):
        self.params = params

    def get(self, key: str):
        return self.params[key].grad


def their_grad(hf: dict, name: str, li) -> torch.Tensor:
    """transformers' gradient of our parameter ``name`` (our fused projections from its split ones)."""
    if hf_split.is_split_name(name):
        return hf_split.read_split(_Grads(hf), name, li)
    return hf_grad(hf, name, q.CONFIG["moe_intermediate_size"])


def _oracle(ref, model, mcfg) -> tuple[float, dict]:
    return next_oracle(ref, model, lambda hf, n: their_grad(hf, n, mcfg.linear))


def _z_rows_swapped(which, li):
    """Planted: in_proj_z's rows of k-head 0 and k-head 1 taken in each other's place."""
    rows = _FUSED_ROWS(which, li)
    if which != "in_proj_qkvz":
        return rows
    per = rows.view(li.k_heads, -1)
    z = li.v_heads // li.k_heads * li.head_v_dim
    per[[0, 1], -z:] = per[[1, 0], -z:].clone()
    return per.reshape(-1)


_FUSED_ROWS = hf_split.fused_rows


def _mrope_rows_zero(rope_cos_sin):
    """Planted: the H and W rows of the interleaved sections [2, 1, 1] taken as position 0 (no turn)
    for a text token, as if only its T row carried the position."""
    def cos_sin(*a, **k):
        cos, sin = rope_cos_sin(*a, **k)
        pairs = cos.shape[-1] // 2
        idx = [i for dim, off in ((1, 1), (2, 2)) for i in range(off, 3 * MROPE["mrope_section"][dim], 3)
               if i < pairs]
        cos, sin = cos.clone(), sin.clone()
        for i in idx:
            cos[..., i] = cos[..., pairs + i] = 1.0
            sin[..., i] = sin[..., pairs + i] = 0.0
        return cos, sin
    return cos_sin


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_one_rank_matches_transformers(saved, kind, monkeypatch):
    path, ref = saved[kind]
    model, mcfg = _ours(path)
    assert mcfg.linear.proj == "split" and (mcfg.moe.num_experts == 4) == (kind == "moe")
    logits, grads = _oracle(ref, model, mcfg)
    print(f"qwen3.5 {kind}: logits rel err {logits:.1e}, grads max {max(grads.values()):.1e} "
          f"({max(grads, key=grads.get)}) over {len(grads)}")
    assert logits < LOGITS_TOL and max(grads.values()) < GRAD_TOL, grads
    if kind == "moe":
        return _fused_experts_read(path, ref, model)
    import paralayer.model.transformer as tr

    for plant in ("z_rows_swapped", "mrope_h_w_rows_zero"):
        with monkeypatch.context() as mp:
            if plant == "z_rows_swapped":
                mp.setattr(hf_split, "fused_rows", _z_rows_swapped)
            else:
                mp.setattr(tr, "rope_cos_sin", _mrope_rows_zero(tr.rope_cos_sin))
            bad, _ = _ours(path)
            if plant == "z_rows_swapped":
                mp.undo()  # transformers' gradients read back in the right rows
            e, g = _oracle(ref, bad, mcfg)
        print(f"qwen3.5 planted {plant}: logits rel err {e:.1e}, grads max {max(g.values()):.1e}")
        assert e > 100 * LOGITS_TOL and max(g.values()) > 100 * GRAD_TOL, (plant, e, max(g.values()))


def _fused_experts_read(path: str, ref, model) -> None:
    """The same MoE checkpoint with its experts stored fused (``mlp.experts.gate_up_proj`` (E, 2F, d),
    ``down_proj``: the module's own layout, as a checkpoint may keep it) reads the same weights."""
    import shutil

    from safetensors.torch import save_file

    fused = path + "-fused"
    os.makedirs(fused, exist_ok=True)
    shutil.copy(os.path.join(path, "config.json"), fused)
    state = {k: v.detach().contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, os.path.join(fused, "model.safetensors"))
    again, _ = _ours(fused)
    ours = dict(model.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in again.named_parameters())


def save_vl(path: str):
    """transformers' vision-language Qwen3_5ForConditionalGeneration (the dense text model, tied
    embeddings, a one-block vision tower), saved by its own save_pretrained."""
    import transformers

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    cfg = transformers.Qwen3_5Config(text_config=text_config("dense", tie_word_embeddings=True),
                                     vision_config=vision, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    ref = _widened(transformers.Qwen3_5ForConditionalGeneration(cfg), 13)
    ref.save_pretrained(path, safe_serialization=True)
    return ref


@pytest.fixture(scope="module")
def saved_vl(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_5_vl") / "hf")
    return path, save_vl(path)


def test_vision_language_wrapper(saved_vl, capfd):
    """The wrapper's checkpoint (text tower under model.language_model., a vision tower, tied
    embeddings): ours from it equals its own text-only forward, whose 3-D positions (get_rope_index)
    go through the interleaved sections; the vision tower is said unread. (Under tp2: below.)"""
    path, ref = saved_vl
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3_5"
    model, mcfg = _ours(path)
    assert mcfg.tie_embeddings and mcfg.linear.proj == "split"
    err = capfd.readouterr().err
    assert "text tower (model.language_model.*) is read; model.visual.* (" in err, err
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        e = _rel(model(x), ref(input_ids=x).logits)
    print(f"qwen3.5 vision-language wrapper, text only: logits rel err {e:.1e}")
    assert e < LOGITS_TOL


@pytest.mark.parametrize("kind, edit, words", [
    ("moe", {"norm_topk_prob": False}, "norm_topk_prob=false is not supported: Qwen3_5MoeForCausalLM ignores it"),
    ("moe", {"mlp_only_layers": [0]}, "mlp_only_layers=[0] is not supported"),
    ("moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ("dense", {"num_experts": 8}, "num_experts=8 is not supported: Qwen3_5ForCausalLM ignores it"),
    ("dense", {"attn_output_gate": False}, "attn_output_gate=false is not supported"),
    ("dense", {"rope_parameters": {"rope_theta": 5000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 2]}},
     "rope_parameters.mrope_section=[2, 2] must be three whole numbers"),
    ("vl", {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, "model_type qwen3_5 is read as qwen3_5_text "
                                                                        "only when architectures is "
                                                                        "['Qwen3_5ForConditionalGeneration']"),
    ("vl", {"tie_word_embeddings": True}, "tie_word_embeddings=true but text_config.tie_word_embeddings=false"),
    ("vl", {"text_config": {"model_type": "qwen3_5_moe_text"}}, 'text_config.model_type="qwen3_5_moe_text" in '
                                                                "a qwen3_5 config; qwen3_5 wraps qwen3_5_text"),
])
def test_what_the_class_would_not_build_is_refused_by_name(tmp_path, kind, edit, words):
    body = {"model_type": "qwen3_5", "text_config": text_config("dense")} if kind == "vl" else \
        {"model_type": f"qwen3_5{'_moe' if kind == 'moe' else ''}_text", **text_config(kind)}
    (tmp_path / "config.json").write_text(json.dumps({**body, **edit}))
    with pytest.raises(HFFormatError) as exc:
        load_hf_config(str(tmp_path))
    assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_defaults_are_the_classes(tmp_path):
    """A config.json that leaves a key out reads as transformers' class builds it; the MoE wrapper
    (qwen3_5_moe) reads its text_config as qwen3_5_moe_text."""
    import transformers

    from paralayer.families.qwen3_5 import text_config as tc

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text_config("moe"),
                                                      "architectures": ["Qwen3_5MoeForConditionalGeneration"]}))
    c = load_hf_config(str(tmp_path))
    assert c["moe"]["num_experts"] == 4 and c["moe"]["shared_ffn_hidden"] == 48 and c["linear"]["proj"] == "split"

    for defaults, cls in ((tc.DENSE_DEFAULTS, transformers.Qwen3_5TextConfig),
                          (tc.MOE_DEFAULTS, transformers.Qwen3_5MoeTextConfig)):
        c = cls()
        assert {k: getattr(c, k) for k in defaults} == defaults, cls.__name__
        assert (c.head_dim, c.rope_parameters["partial_rotary_factor"], c.layer_types[:4]) == \
            (256, 0.25, ["linear_attention"] * 3 + ["full_attention"])


def test_tiny_recipes_count_their_parameters():
    """The resolver's parameter count equals the model's for both tiny recipes (dense MLPs on the
    linear layers too, and Qwen3.5-MoE's), and each exports as its own class."""
    from paralayer.config import load_config
    from paralayer.families import family_for_config
    from paralayer.model.transformer import Transformer
    from paralayer.resolve.memory import parameter_counts

    for recipe, cls in (("tiny-qwen3.5", "Qwen3_5ForCausalLM"), ("tiny-qwen3.5-moe", "Qwen3_5MoeForCausalLM")):
        cfg = load_config(recipe=recipe)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        assert parameter_counts(cfg)["total"] == sum(p.numel() for p in model.parameters()), recipe
        assert family_for_config(cfg.model).HF_CLASS == cls


# ------------------------------------------------------------------ multi-rank, through the runtime
LAYOUTS = {"tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"], "pp2": ["parallel.pp=2",
           "parallel.schedule=1f1b"], "cp2": ["parallel.cp=2"], "dp2_zero3": ["parallel.dp=2", "parallel.zero=3"],
           "ep2": ["parallel.dp=2", "parallel.ep=2"]}
RUNS = [(k, lay) for k in ("dense", "moe") for lay in LAYOUTS if not (k == "dense" and lay == "ep2")]
RUNS.append(("vl", "tp2"))  # the wrapper's checkpoint, each tp rank reading its slices through the prefix
TRIPS = {"dense": LAYOUTS["tp2"], "moe": LAYOUTS["ep2"]}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.dist import write_tokens

    return write_tokens(str(tmp_path_factory.mktemp("tok") / "t.jsonl"), 3 * BATCH, SEQ, VOCAB)


def _trip(overrides: list, out: str) -> list:
    """Import, steps 1 and 2, export, then step 3's loss (of the exported weights, before its update)."""
    from paralayer.checkpoint.hf import export_hf
    from paralayer.runtime.build import as_plan
    from paralayer.runtime.train import setup, train_step
    from tests.dist import cfg_and_plan

    cfg, plan = cfg_and_plan(overrides)
    run = setup(cfg, as_plan(plan), None)
    losses = [train_step(run, s)["loss"] for s in (1, 2)]
    export_hf(run.built.chunks, cfg.model, out)
    return losses + [train_step(run, 3)["loss"]]


def _worker(rank, world, runs, trips):
    from tests.test_families import _grads_worker

    return _grads_worker(rank, world, runs), [_trip(o, d) for o, d in trips]


@pytest.fixture(scope="module")
def world(saved, saved_vl, tokens, tmp_path_factory):
    """({(kind, layout): [(loss, grads) per rank]}, {kind: (rank 0's losses of steps 1-3, export dir)}):
    every run in one forked 2-rank world."""
    from tests.dist import run_ranks

    out = tmp_path_factory.mktemp("export")
    src = {**saved, "vl": saved_vl}
    runs = [_overrides(src[k][0], tokens, LAYOUTS[lay]) for k, lay in RUNS]
    trips = [(_overrides(saved[k][0], tokens, TRIPS[k] + ["train.steps=3"]), str(out / k)) for k in TRIPS]
    res = run_ranks(_worker, 2, runs, trips, timeout_s=600)
    layouts = {r: [res[rank][0][i] for rank in range(2)] for i, r in enumerate(RUNS)}
    return layouts, {k: (res[0][1][i], trips[i][1]) for i, k in enumerate(TRIPS)}


@pytest.mark.parametrize("kind, layout", RUNS)
def test_layouts_match_transformers(saved, saved_vl, tokens, world, kind, layout):
    """(vl: the wrapper's checkpoint read under tp2, each rank its own slices through the prefix;
    transformers' gradients by the text model's names.)"""
    from tests.test_hf_moe import layout_errors, reference_loss

    path, ref = saved_vl if kind == "vl" else saved[kind]
    want = reference_loss(ref, tokens, BATCH)
    hf = {k.replace(TEXT_PREFIX, "model."): p for k, p in ref.named_parameters()}
    li = _ours(path)[1].linear
    tied = {"output.weight": "tok_embeddings.weight"} if kind == "vl" else {}  # two copies, the summed gradient
    loss_err, errs = layout_errors(world[0][(kind, layout)], layout, want,
                                   lambda n: their_grad(hf, tied.get(n, n), li))
    print(f"qwen3.5 {kind} {layout}: loss {loss_err:.1e}, grads max {max(errs.values()):.1e} "
          f"({max(errs, key=errs.get)}) over {len(errs)}")
    assert set(errs) == {n for n, _ in _ours(path)[0].named_parameters()}  # every parameter came back
    assert loss_err < LOGITS_TOL and max(errs.values()) < GRAD_TOL, (loss_err, errs)


@pytest.mark.parametrize("kind", list(TRIPS))
def test_round_trip_loss_on_the_next_batch(saved, tokens, world, kind):
    """transformers loads the export as its text class; its loss on batch 3 equals the loss our
    runtime computed for step 3 from the same weights; the config says what the import read."""
    import transformers
    from safetensors import safe_open

    losses, out = world[1][kind]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").float().eval()
    assert type(back).__name__ == type(saved[kind][1]).__name__
    src, exp = (json.load(open(os.path.join(d, "config.json"))) for d in (saved[kind][0], out))
    assert exp["model_type"] == src["model_type"]
    for key in ("layer_types", "linear_num_value_heads", "linear_value_head_dim", "shared_expert_intermediate_size"):
        assert exp.get(key) == src.get(key), key
    assert exp["rope_parameters"] == {k: v for k, v in src["rope_parameters"].items() if k not in MROPE}
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert "model.layers.0.linear_attn.in_proj_z.weight" in f.keys()
    x = torch.tensor([json.loads(line)["input_ids"] for line in open(tokens)][2 * BATCH:3 * BATCH])
    with torch.no_grad():
        theirs = back(input_ids=x, labels=x).loss.item()
        moved = max(_rel(p, r) for p, r in zip(back.parameters(), saved[kind][1].parameters()))
    err = abs(losses[2] - theirs) / theirs
    print(f"qwen3.5 {kind} round trip: losses {losses}; transformers' on the next batch {theirs:.7f} "
          f"(rel err {err:.1e}); weights moved {moved:.1e}")
    assert err < LOGITS_TOL and moved > 1e-4 and losses[0] != losses[2]
