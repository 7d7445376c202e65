"""Tensor parallel: the activations each rank saves for backward, measured against the resolver's
``act_elems_per_token`` (per layer, with and without sequence parallel and tp_overlap) and
``head_saved_elems`` (the final norm and the head)."""
from __future__ import annotations

import pytest
import torch

from paralayer.model.transformer import Transformer, init_weights, lm_loss
from tests.dist import run_ranks
from tests.test_tensor import B, S, batches, tiny, tp_model

torch.set_num_threads(1)


REGIONS = ("norms", "block", "head")


def _saved_bytes(model, tokens, labels, loss_fn) -> dict:
    """Bytes saved for backward per rank (local shards, unique storages, parameters excluded):
    ``norms`` inside the RMSNorm modules, ``block`` inside layer 0 (RoPE tables excluded too),
    ``head`` inside the final norm and the output head."""
    from torch.distributed.tensor import DTensor

    depth = {r: 0 for r in REGIONS}
    total = {r: 0 for r in REGIONS}
    seen = {r: set() for r in REGIONS}
    excluded = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in model.parameters()}

    def enter(region, args=()):
        def hook(m, a, *out):
            depth[region] += -1 if out else 1
            if region == "block" and not out:
                excluded.update(t.untyped_storage().data_ptr() for t in a[1:])  # cos, sin
        return hook

    def pack(t):
        loc = t.to_local() if isinstance(t, DTensor) else t
        loc = getattr(loc, "elem", loc)  # AsyncCollectiveTensor (an all-gather's output)
        st = loc.untyped_storage()
        for region in REGIONS:
            if depth[region] and st.data_ptr() not in excluded and st.data_ptr() not in seen[region]:
                seen[region].add(st.data_ptr())
                total[region] += st.nbytes()
        return t

    handles = []
    for m in model.modules():
        if isinstance(m, torch.nn.RMSNorm):
            handles += [m.register_forward_pre_hook(enter("norms")), m.register_forward_hook(enter("norms"))]
    blk = model.layers["0"]
    handles += [blk.register_forward_pre_hook(enter("block")), blk.register_forward_hook(enter("block"))]
    for m in (model.norm, model.output):
        handles += [m.register_forward_pre_hook(enter("head")), m.register_forward_hook(enter("head"))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(tokens), labels)
    loss.backward()
    for h in handles:
        h.remove()
    return total


def _act_worker(rank, world, cfg, tokens, labels, sps):
    """``sps``: True / False (sequence parallel on / off) or "overlap" (SP with tp_overlap)."""
    from torch.distributed.device_mesh import init_device_mesh

    from paralayer.parallel.tensor import loss_parallel_ctx, tp_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for sp in sps:
        model = tp_model(mesh["tp"], cfg, sp is not False, sp == "overlap")
        with loss_parallel_ctx(True):
            out[sp] = _saved_bytes(model, tokens, labels, lambda lg, lb: tp_loss(lg, lb, cfg.vocab_size))
    return out


def _plan_act_bytes_per_layer(tp: int, sp) -> float:
    """The resolver's activation bytes for one layer of one microbatch (B×S tokens, fp32)."""
    from paralayer.config import load_config
    from paralayer.resolve import memory, rules

    cfg = load_config(["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
                       "model.ffn_hidden=96", "model.vocab_size=61", f"model.seq_len={S}",
                       f"parallel.tp={tp}", "parallel.dp=1",
                       f"parallel.sequence_parallel={str(sp is not False).lower()}",
                       f"parallel.tp_overlap={str(sp == 'overlap').lower()}",
                       f"train.global_batch={B}", f"train.micro_batch={B}", "train.precision=fp32"])
    lay = rules.check(cfg)
    return memory.act_elems_per_token(cfg, lay, False, "none") * B * S * memory.ACT_BYTES["fp32"]


@pytest.mark.parametrize("tp", [2, 4])
def test_activation_bytes(tp):
    """SP: the norm regions save <= 1/tp (+10%) of tp=1; the plan's per-layer activations agree
    with the measured saved tensors within 5% (with and without SP)."""
    cfg = tiny()
    tokens, labels = batches(cfg, 1)[0]
    model = Transformer(cfg)
    init_weights(model, cfg, seed=0)
    base = _saved_bytes(model, tokens, labels, lambda lg, lb: lm_loss(lg, lb, cfg.vocab_size))
    assert base["norms"] >= B * S * cfg.d_model * 4 * (2 * cfg.n_layers + 1)  # every norm saves its input
    sps = (True, False, "overlap") if tp == 2 else (True, "overlap")
    per_rank = run_ranks(_act_worker, tp, cfg, tokens, labels, sps)
    measured = {(1, False): base["block"]}
    for sp in sps:
        norms = [r[sp]["norms"] for r in per_rank]
        print(f"[tp={tp} sp={sp}] norm-region bytes per rank {norms} vs tp=1 {base['norms']}; "
              f"layer bytes {per_rank[0][sp]['block']} vs tp=1 {base['block']}")
        if sp is not False:
            assert all(n <= base["norms"] / tp * 1.10 for n in norms), (base, norms)
        else:  # without SP every tp rank saves the whole sequence in the norms
            assert all(n == base["norms"] for n in norms), (base, norms)
        measured[(tp, sp)] = max(r[sp]["block"] for r in per_rank)
    for (t, sp), got in measured.items():
        pred = _plan_act_bytes_per_layer(t, sp)
        print(f"[tp={t} sp={sp}] layer activations: measured {got} B, plan {pred:.0f} B ({pred / got - 1:+.1%})")
        assert abs(pred - got) <= 0.05 * got, (t, sp, got, pred)


# ------------------------------------------------------------------ the final norm and the head
@pytest.mark.parametrize("tp", [2, 4])
def test_head_activation_bytes_match_plan(tp):
    """The final norm + head save (1 + 2/tp)·h per token under SP, 3·h without (memory.head_saved_elems)."""
    from paralayer.resolve.memory import head_saved_elems
    from paralayer.resolve.rules import Layout

    cfg = tiny()
    tokens, labels = batches(cfg, 1)[0]
    got = run_ranks(_act_worker, tp, cfg, tokens, labels, (True, False))[0]
    for sp in (True, False):
        plan = head_saved_elems(Layout(tp=tp, sequence_parallel=sp), cfg.d_model) * B * S * 4
        print(f"[tp={tp} sp={sp}] head region {got[sp]['head']} B, plan {plan:.0f} B")
        assert abs(got[sp]["head"] - plan) <= 0.02 * plan, (sp, got[sp]["head"], plan)
