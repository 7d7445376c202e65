"""The resolver against the seeds' worked figures, hand-computed memory, and its layout outputs."""
from __future__ import annotations

import pytest

from paralayer.config import load_config
from paralayer.resolve import resolve
from paralayer.resolve.cost import bubble_fraction


def plan(*ovs: str):
    return resolve(load_config(list(ovs)))


def fields(p) -> set[str]:
    return {e["field"] for e in p.errors}


# ------------------------------------------------------------------ the seeds' worked figures
@pytest.mark.parametrize("layers,pp,vpp,gb,expected", [
    (16, 4, 1, 4, 0.75),          # p=4, m=4: (p-1)/m
    (16, 4, 1, 64, 0.046875),     # p=4, m=64
    (16, 16, 1, 32, 0.46875),     # p=16, m=32
    (64, 16, 4, 32, 0.1171875),   # p=16, m=32, v=4: (p-1)/(v·m)
])
def test_bubble_worked_figures(layers, pp, vpp, gb, expected):
    sched = "interleaved" if vpp > 1 else "1f1b"
    p = plan(f"model.n_layers={layers}", f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.schedule={sched}",
             "parallel.dp=1", f"train.global_batch={gb}", "train.micro_batch=1")
    assert p.microbatches == gb
    assert p.bubble_fraction == expected
    assert p.valid


def test_bubble_formulas_per_schedule():
    assert bubble_fraction("gpipe", 4, 4) == 0.75
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert bubble_fraction("zbv", 4, 8) == 3 / 48         # torch's ZB-V order: (p-1)/(6m) for m >= 3p/2
    assert bubble_fraction("zbv", 4, 4) == 6 / 24         # m < 3p/2: 3p-2m-1 more idle passes
    assert bubble_fraction("dualpipev", 4, 8) == 3 / 48   # torch's DualPipeV order, as ZB-V's


def test_tp_all_reduce_message_seed_figure():
    """s=4096, h=8192, b=1, bf16: s·b·h·2 = 67,108,864 bytes, 4 per layer per microbatch."""
    p = plan("recipe=llama3-70b", "model.seq_len=4096", "parallel.sequence_parallel=false")
    tp = p.comm["tp"]
    assert tp["collective"] == "all-reduce"
    assert tp["message_bytes"] == 67_108_864
    # 80 layers / pp=4 on this rank, + the vocab-parallel embedding's all-reduce (rank 0 holds it)
    assert tp["count_per_step"] == (4 * 20 + 1) * p.microbatches
    # the two row GEMMs' output all-reduces move bf16; the two column GEMMs' input-gradient all-reduces
    # move autocast's fp32 stream (ZeRO-1: fp32 weights; rehearsed, tiny tp2 without SP in bf16 read
    # 1.399 of a plan that counted them bf16, 7 Dec), as does the embedding's: 2 + 2·2 units a layer
    assert tp["bytes_per_step"] == 67_108_864 * (6 * 20 + 2) * p.microbatches
    # sequence parallel: all-gather + reduce-scatter, same volume
    sp = plan("recipe=llama3-70b", "model.seq_len=4096").comm["tp"]
    assert sp["collective"] == "all-gather+reduce-scatter" and sp["message_bytes"] == 67_108_864


def test_70b_on_512_devices_gives_dp_16():
    p = plan("recipe=llama3-70b", "cluster=h100-80gb-8x", "cluster.nodes=64")
    assert p.world_size == 512 and p.degrees["dp"] == 16 and p.degrees["tp"] == 8 and p.degrees["pp"] == 4
    assert p.valid and p.fits


def test_tp8_pp8_dp64_needs_4096_devices():
    ok = plan("recipe=llama3-70b", "parallel.pp=8", "parallel.dp=64", "cluster.nodes=512")
    assert ok.world_size == 4096 and ok.valid
    bad = plan("recipe=llama3-70b", "parallel.pp=8", "parallel.dp=64", "cluster.nodes=64")
    assert "parallel.dp" in fields(bad)
    assert "4096" in " ".join(e["message"] for e in bad.errors)


# ------------------------------------------------------------------ memory, hand computed
GIB = 2 ** 30


def test_memory_tiny_fp32_by_hand():
    """tiny: h=128, L=4, a=4, g=2, f=352, V=256, s=128, b=4, dp=2, fp32, zero 0, no recompute, pp=1."""
    p = plan("recipe=tiny", "parallel.tp=1")
    h, L, a, g, f, V, s, b = 128, 4, 4, 2, 352, 256, 128, 4
    hd = h // a
    # parameters (REFERENCE.md): attention 2h²(1+g/a) = h·hd·(2a+2g), SwiGLU 3hf, norms 2h; untied hV ×2; final norm h
    per_layer = h * hd * (2 * a + 2 * g) + 3 * h * f + 2 * h
    n = L * per_layer + 2 * V * h + h
    assert p.parameters["total"] == n == 803_968
    mem = p.memory_per_device_bytes
    # fp32 Adam, ZeRO-0: weights 4 + grads 4 + m,v 8 bytes per parameter
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * n, 4 * n, 8 * n)
    # activations (measured on our block, see memory.py): 8h + 4f + a + 2 elements per token per layer,
    # fp32 logits 4·s·b·V, plus the final norm's input and 1/rms and the head's input (2h + 1)·s·b;
    # one microbatch in flight (no pipeline); RoPE's cos and sin, (s, hd) each in fp32, saved once
    tokens = s * b
    rope = 2 * s * hd * 4
    acts = L * (8 * h + 4 * f + a + 2) * tokens * 4 + 4 * tokens * V + (2 * h + 1) * tokens * 4 + rope
    assert mem["activations"] == acts
    assert mem["total"] == 16 * n + acts
    assert mem["capacity"] is None and p.fits  # local CPU: capacity unknown → assumed to fit, with a note
    assert any("unknown" in x for x in p.notes)


def test_memory_llama3_70b_by_hand():
    """70B, bf16, tp=8, pp=4 (1F1B), dp=16, ZeRO-1, selective recompute, SP: first stage (rank 0)."""
    p = plan("recipe=llama3-70b")
    h, a, g, f, V, s, b = 8192, 64, 8, 28672, 128256, 8192, 1
    t, pp, d = 8, 4, 16
    hd = h // a
    layers = 80 // pp
    # rank 0: 20 layers (attention and MLP split over tp, norms replicated) + the vocab-parallel embedding
    dense = layers * (h * hd * (2 * a + 2 * g) / t + 3 * h * f / t + 2 * h) + V * h / t
    mem = p.memory_per_device_bytes
    # bf16 as the runtime runs it at ZeRO-1 (autocast, paralayer/runtime/precision.py): fp32 weights 4
    # (no bf16 copy is kept here: SP's GEMMs cast again in backward, the head is on the last stage),
    # fp32 grads 4, Adam m, v 8/d (sharded over dp)
    assert mem["params"] == int(4 * dense)
    assert mem["grads"] == int(4 * dense)
    # Adam's m, v (8 B) of ZeRO-1's busiest data rank: the runtime deals whole tensors, largest first,
    # to the least-loaded rank (parallel/data.py ZeroOneOptimizer), so the plan takes that rank's share
    sizes = [V * h // t] + layers * ([h * hd * a // t, h * hd * g // t, h * hd * g // t, hd * a * h // t]
                                     + [h * f // t] * 3 + [h, h])
    loads = [0] * d
    for n in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += n
    assert sum(loads) == dense and max(loads) > dense / d
    assert mem["optimizer"] == int(8 * max(loads))
    # activations, selective + SP: 2h/t (the column GEMMs' inputs, saved as the sequence shard and
    # re-gathered in backward) + (h+2)/t (norm inputs, 1/rms, residual) + (3h + 2h·g/a + 3f)/t per
    # token per layer, in bf16 (2 bytes); bf16 under autocast (ZeRO-1) keeps in fp32 the stream the
    # norms save and their 1/rms, (2h + 2)/t more, and the column GEMMs' shards, 2h/t more;
    # 1F1B's first stage holds p microbatches (Megatron / Korthikanti et al.), each with its RoPE
    # cos and sin ((s, hd) each, fp32: the stream's dtype under autocast)
    per_token = 2 * h / t + (h + 2) / t + (3 * h + 2 * h * g / a + 3 * f) / t + (2 * h + 2) / t + 2 * h / t
    rope = 2 * s * hd * 4
    acts = min(p.microbatches, pp) * (layers * per_token * s * b * 2 + rope)
    assert mem["activations"] == int(acts)
    assert p.memory_stage == 0
    assert 41 * GIB < mem["total"] < 46 * GIB and p.fits


def test_memory_follows_zero_recompute_and_schedule():
    m = {z: plan("recipe=llama3-70b", "parallel.pp=1", f"parallel.zero={z}").memory_per_device_bytes
         for z in range(4)}
    # ZeRO-1 deals whole tensors (its busiest rank holds a little more than 1/d), FSDP shards each one
    assert m[0]["optimizer"] > m[1]["optimizer"] > m[2]["optimizer"] == m[3]["optimizer"]
    assert m[1]["optimizer"] < 1.05 * m[2]["optimizer"]
    assert m[1]["grads"] > m[2]["grads"] and m[2]["params"] > m[3]["params"]
    # under pp our stages reduce-scatter every microbatch (parallel/pipeline/stage_hooks.py): ZeRO 2/3 hold
    # 1/dp of the stage's grads at the peak, as without pp (tests/test_dist_optimizer.py measures it)
    q = {z: plan("recipe=llama3-70b", f"parallel.zero={z}").memory_per_device_bytes for z in (1, 2, 3)}
    assert q[1]["grads"] == pytest.approx(16 * q[2]["grads"], rel=1e-6) and q[2]["grads"] == q[3]["grads"]
    assert q[3]["optimizer"] < q[1]["optimizer"] < 1.01 * q[3]["optimizer"]
    # the V schedules too (the reduce-scatter starts after each weight pass)
    v = {z: plan("recipe=llama3-70b", f"parallel.zero={z}", "parallel.schedule=zbv").memory_per_device_bytes
         for z in (1, 2)}
    assert v[1]["grads"] == pytest.approx(16 * v[2]["grads"], rel=1e-6)
    r = {x: plan("recipe=llama3-70b", f"parallel.recompute={x}").memory_per_device_bytes["activations"]
         for x in ("none", "selective", "full")}
    assert r["none"] > r["selective"] > r["full"]
    gp = plan("recipe=llama3-70b", "parallel.schedule=gpipe").memory_per_device_bytes["activations"]
    assert gp > r["selective"] * 7  # GPipe holds all m=32 microbatches, 1F1B p=4
    # interleaved (p 4, v 2): rank 0 holds (v-1)p + 2(p-1) + 1 = 11 chunk-microbatches, 11/2 layer
    # sets against 1F1B's 4 (torch's order; Megatron's 1 + (p-1)/(pv)), each chunk with its RoPE tables
    rope = 2 * 8192 * 128 * 4
    il = plan("recipe=llama3-70b", "parallel.schedule=interleaved", "parallel.vpp=2")
    assert il.memory_per_device_bytes["activations"] - 11 * rope == pytest.approx(
        (r["selective"] - 4 * rope) * (1 + 3 / 8), rel=1e-6)
    cp2 = plan("recipe=llama3-70b", "parallel.cp=2", "cluster.nodes=128")
    assert cp2.memory_per_device_bytes["activations"] == pytest.approx(r["selective"] / 2, rel=1e-6)


def test_moe_parameters_and_expert_sharding():
    p = plan("recipe=mixtral-8x7b")
    assert p.parameters["active"] < p.parameters["total"]
    e1 = plan("recipe=mixtral-8x7b", "parallel.ep=1").memory_per_device_bytes["params"]
    assert p.memory_per_device_bytes["params"] < e1 / 4   # experts dominate and are split 8 ways
    assert p.expert_grid == {"ep": 8, "edp": 1}
    assert p.comm["ep"]["collective"] == "all-to-all" and p.comm["ep"]["count_per_step"] == 4 * 8 * p.microbatches


# ------------------------------------------------------------------ layout outputs the runtime reads
def test_stage_layers_interleaved_and_v_shape():
    p = plan("model.n_layers=8", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved",
             "parallel.dp=1", "train.global_batch=4", "train.micro_batch=1")
    assert p.stage_layers == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.chunk_ranks == [0, 1, 0, 1]
    z = plan("model.n_layers=8", "parallel.pp=2", "parallel.schedule=zbv", "parallel.dp=1",
             "train.global_batch=4", "train.micro_batch=1")
    assert z.degrees["vpp"] == 2 and z.chunk_ranks == [0, 1, 1, 0]
    assert any("vpp set to 2" in n for n in z.notes)


def test_uneven_pp_layout():
    p = plan("model.n_layers=5", "parallel.pp=2", "parallel.pp_layout=[2,3]", "parallel.dp=1")
    assert p.valid and p.stage_layers == [[0, 1], [2, 3, 4]]


def test_vocab_is_padded_not_rejected():
    p = plan("model.vocab_size=255", "parallel.tp=2", "parallel.dp=1")
    assert p.valid and p.padded_vocab_size == 256
    assert any("padded to 256" in n for n in p.notes)


def test_dp_auto_and_local_world():
    p = plan("parallel.tp=2", "parallel.dp=auto")
    assert p.world_size == 2 and p.degrees["dp"] == 1       # local: product of degrees, auto counts as 1
    p = plan("parallel.tp=2", "parallel.dp=auto", "cluster.devices_per_node=8")
    assert p.world_size == 8 and p.degrees["dp"] == 4


def test_sequence_parallel_resolution():
    assert plan("parallel.tp=2", "parallel.dp=1").sequence_parallel is True
    p = plan("parallel.sequence_parallel=true", "parallel.dp=1", "parallel.tp=1")
    assert p.sequence_parallel is False
    assert "parallel.sequence_parallel" in {w["field"] for w in p.warnings}


def test_spans_and_device():
    p = plan("recipe=llama3-70b")
    assert p.spans["tp"] == "intra-node" and p.spans["pp"] == "inter-node" and p.spans["dp"] == "inter-node"
    assert p.device == "cuda" and p.peak_tflops == 989 and p.precision == "bf16"
    t = plan("recipe=tiny", "parallel.tp=1")
    assert t.device == "cpu" and t.peak_tflops is None and t.precision == "fp32"


def test_flops_per_token():
    """6·N + 12·L·h·s, N = matmul parameters including the output head (torchtitan convention)."""
    p = plan("recipe=tiny", "parallel.tp=1")
    h, L, a, g, f, V, s = 128, 4, 4, 2, 352, 256, 128
    n = L * (h * (h // a) * (2 * a + 2 * g) + 3 * h * f) + h * V
    assert p.flops_per_token == 6 * n + 12 * L * h * s


def test_all_violations_are_collected():
    p = plan("parallel.tp=3", "parallel.pp=3", "train.global_batch=7", "parallel.ep=2", "parallel.dp=2")
    assert {"parallel.tp", "parallel.pp", "train.global_batch", "parallel.ep"} <= fields(p)
    assert len(p.errors) >= 5 and not p.valid


def test_plan_json_contract_keys():
    d = plan("recipe=llama3-70b").to_dict()
    for k in ("world_size", "degrees", "microbatches", "bubble_fraction", "memory_per_device_bytes", "fits",
              "parameters", "comm", "flops_per_token", "errors", "warnings", "sequence_parallel",
              "padded_vocab_size", "stage_layers", "schedule", "device", "peak_tflops", "expert_grid", "spans",
              "valid"):
        assert k in d, k
    assert set(d["degrees"]) == {"tp", "pp", "vpp", "cp", "ep", "dp"}
    assert {"params", "grads", "optimizer", "activations", "total", "capacity"} <= set(d["memory_per_device_bytes"])
    for ax in ("tp", "pp", "cp", "ep", "dp"):
        assert {"collective", "message_bytes", "count_per_step", "bytes_per_step"} <= set(d["comm"][ax])


def test_rank_chunks_inverts_chunk_rank():
    """memory.rank_chunks (closed form, the planner's hot path) lists exactly the chunks that
    rules.chunk_rank puts on each rank, for every schedule, pp 1-16 and vpp 1-4."""
    from types import SimpleNamespace

    from paralayer.resolve.memory import rank_chunks
    from paralayer.resolve.rules import chunk_rank

    for sched, vpps in (("1f1b", (1,)), ("gpipe", (1,)), ("interleaved", (2, 3, 4)), ("zbv", (2,)), ("dualpipev", (2,))):
        for pp in range(1, 17):
            for v in vpps:
                lay = SimpleNamespace(pp=pp, schedule=sched, chunks=pp * v)
                for r in range(-1, pp + 1):
                    assert rank_chunks(lay, r) == [c for c in range(pp * v) if chunk_rank(c, pp, sched) == r]
