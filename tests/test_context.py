"""Context parallel: zigzag sharding and ring attention on real gloo ranks.

Every rank builds the same full-sequence q/k/v (same seed), runs plain causal SDPA on it as the
reference, then runs ring attention on its zigzag shard and compares output and q/k/v gradients
with the matching rows of the reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paralayer.parallel.context import (
    RingAttention,
    RingStats,
    make_ring_attention,
    ring_attention,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)
from tests.dist import run_ranks

TOL = 1e-5

# (b, n_heads, n_kv_heads, seq_len, head_dim, causal, seed)
CASES = [
    (2, 4, 4, 32, 16, True, 0),    # MHA
    (2, 4, 4, 32, 16, True, 1),
    (1, 4, 2, 32, 16, True, 2),    # GQA 2:1
    (2, 6, 2, 48, 8, True, 3),     # GQA 3:1
    (1, 4, 1, 32, 16, True, 4),    # MQA
    (2, 4, 2, 32, 16, False, 5),   # non-causal GQA
]


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_indices_and_round_trip(cp):
    seq = 8 * cp
    c = seq // (2 * cp)
    all_idx = torch.cat([zigzag_indices(seq, cp, r) for r in range(cp)])
    assert sorted(all_idx.tolist()) == list(range(seq))
    for r in range(cp):
        idx = zigzag_indices(seq, cp, r)
        assert idx.dtype == torch.long and idx.numel() == 2 * c
        assert idx[:c].tolist() == list(range(r * c, (r + 1) * c))
        assert idx[c:].tolist() == list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    x = torch.randn(2, 3, seq, 5)
    parts = [zigzag_shard(x, 2, cp, r) for r in range(cp)]
    for r, p in enumerate(parts):
        assert torch.equal(p, x.index_select(2, zigzag_indices(seq, cp, r)))
    assert torch.equal(zigzag_unshard(parts, 2, cp), x)
    y = torch.arange(seq * 3).view(seq, 3)
    assert torch.equal(zigzag_unshard([zigzag_shard(y, 0, cp, r) for r in range(cp)], 0, cp), y)


def test_zigzag_rejects_bad_lengths():
    with pytest.raises(ValueError, match="divisible"):
        zigzag_indices(10, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        zigzag_indices(8, 2, 2)


def test_gqa_head_mismatch_is_rejected():
    q = torch.randn(1, 4, 8, 4)
    k = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q, k, k)


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_single_rank_matches_sdpa(backend):
    errs = _compare(0, 1, None, (2, 4, 2, 16, 8, True, 7), backend=backend)
    assert max(errs.values()) < TOL, errs


def test_strided_inputs_from_bshd_layout():
    """The model projects to (b, s, h, d) and transposes: non-contiguous views must work."""
    torch.manual_seed(0)
    q = torch.randn(2, 16, 4, 8).transpose(1, 2)
    k = torch.randn(2, 16, 2, 8).transpose(1, 2)
    v = torch.randn(2, 16, 2, 8).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         is_causal=True)
    assert (RingAttention()(q, k, v) - ref).abs().max().item() < TOL


# ---------------------------------------------------------------------------------------------
# multi-rank
# ---------------------------------------------------------------------------------------------

def _compare(rank, cp, group, case, attn=None, backend=None):
    b, h, hkv, seq, d, causal, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, seq, d, generator=g)
    k = torch.randn(b, hkv, seq, d, generator=g)
    v = torch.randn(b, hkv, seq, d, generator=g)
    w = torch.randn(b, h, seq, d, generator=g)  # upstream gradient

    # reference: full sequence, one process
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(h // hkv, 1),
                                         vr.repeat_interleave(h // hkv, 1), is_causal=causal)
    (ref * w).sum().backward()

    # ring: this rank's zigzag shard
    ql, kl, vl = (zigzag_shard(t, 2, cp, rank).requires_grad_() for t in (q, k, v))
    if attn is None:
        out = ring_attention(ql, kl, vl, group, causal=causal, backend=backend)
    else:
        out = attn(ql, kl, vl, is_causal=causal)
    (out * zigzag_shard(w, 2, cp, rank)).sum().backward()

    def err(a, full):
        return (a - zigzag_shard(full, 2, cp, rank)).abs().max().item()

    return {"out": err(out, ref), "dq": err(ql.grad, qr.grad), "dk": err(kl.grad, kr.grad),
            "dv": err(vl.grad, vr.grad)}


def _ranks_compare(rank, world, cases, backend):
    return [_compare(rank, world, None, case, backend=backend) for case in cases]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_sdpa(cp):
    per_rank = run_ranks(_ranks_compare, cp, CASES, None)
    worst = {key: max(res[i][key] for res in per_rank for i in range(len(CASES)))
             for key in ("out", "dq", "dk", "dv")}
    print(f"cp={cp} max abs errors over {len(CASES)} cases x {cp} ranks: {worst}")
    for r, res in enumerate(per_rank):
        for case, errs in zip(CASES, res):
            assert max(errs.values()) < TOL, (r, case, errs)


def test_math_backend_ring_matches_full_sdpa():
    """The device-independent fallback kernels give the same answer through the ring."""
    per_rank = run_ranks(_ranks_compare, 2, CASES[2:4], "math")
    for res in per_rank:
        for errs in res:
            assert max(errs.values()) < TOL, errs


def _subgroup_ranks(rank, world):
    # a (cp=2, dp=2) layout whose cp groups are {0, 2} and {1, 3}: exercises group→global ranks
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    cp_rank = dist.get_rank(group)
    attn = RingAttention(group)
    errs = _compare(cp_rank, 2, group, (1, 4, 2, 16, 8, True, 10 + rank % 2), attn=attn)
    errs_fn = _compare(cp_rank, 2, group, (1, 4, 2, 16, 8, True, 20), attn=make_ring_attention(group))
    return errs, errs_fn, attn.stats.calls


def test_ring_attention_on_a_subgroup():
    for errs, errs_fn, calls in run_ranks(_subgroup_ranks, 4):
        assert max(errs.values()) < TOL, errs
        assert max(errs_fn.values()) < TOL, errs_fn
        assert calls == 1


def _work_ranks(rank, world, case):
    b, h, hkv, seq, d, causal, seed = case
    torch.manual_seed(seed)
    q = torch.randn(b, h, seq // world, d, requires_grad=True)
    k = torch.randn(b, hkv, seq // world, d, requires_grad=True)
    v = torch.randn(b, hkv, seq // world, d, requires_grad=True)
    stats = RingStats()
    for _ in range(2):
        ring_attention(q, k, v, causal=causal, stats=stats).sum().backward()
    return (stats.pairs_fwd, stats.pairs_bwd, stats.time_fwd_s, stats.time_bwd_s,
            len(stats.last_step_times_fwd_s), stats.calls)


def test_attention_work_is_balanced_across_ranks():
    cp, seq = 4, 64
    res = run_ranks(_work_ranks, cp, (1, 2, 2, seq, 8, True, 0))
    fwd = [r[0] for r in res]
    bwd = [r[1] for r in res]
    assert max(fwd) <= 1.10 * min(fwd), fwd
    assert max(bwd) <= 1.10 * min(bwd), bwd
    # every step costs the same: c = seq/(2cp); step 0 = 2c² + c (two causal triangles), others 2c²
    c = seq // (2 * cp)
    assert fwd[0] == 2 * (cp * 2 * c * c + c)  # two calls
    # and the full causal problem is covered exactly once: sum over ranks = S(S+1)/2 per call
    assert sum(fwd) == 2 * seq * (seq + 1) // 2
    # contiguous causal sharding would give rank r (r+1) blocks: far from balanced
    contiguous = [(r + 1) * (seq // cp) ** 2 for r in range(cp)]
    assert max(contiguous) > 1.10 * min(contiguous)
    assert all(r[4] == cp and r[5] == 2 for r in res)
    times = [r[2] for r in res]
    print(f"pairs fwd per rank {fwd}; fwd compute s per rank {[f'{t:.4f}' for t in times]}")
