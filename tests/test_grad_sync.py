"""The ZeRO-0/1 gradient reducer (paralayer/parallel/grad_sync.py): buckets start during the last
microbatch's backward, in the same order on every rank, and the averages equal one flat all-reduce."""
from __future__ import annotations

import torch
import torch.distributed as dist

from paralayer.config import ModelConfig
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from tests.dist import run_ranks

torch.set_num_threads(1)
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=16)
M = 3


def _worker(rank, world, bucket_bytes, divide_m):
    from paralayer.parallel.grad_sync import GradReducer

    torch.manual_seed(0)
    model = Transformer(CFG)
    init_weights(model, CFG, seed=0)
    params = list(model.parameters())
    reducer = GradReducer(params, dist.group.WORLD, world, microbatches=M, bucket_bytes=bucket_bytes,
                          divide=world * (M if divide_m else 1))
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    out = []
    for _step in range(2):
        for p in params:
            p.grad = None
        started_during = []
        for _k in range(M):
            toks = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
            loss = lm_loss(model(toks[:, :-1]), toks[:, 1:], CFG.vocab_size)
            (loss if divide_m else loss / M).backward()
            started_during.append(reducer._started_now)
        # the reference: one flat all-reduce of the same summed grads
        ref = torch.cat([p.grad.reshape(-1) for p in params]).clone()
        dist.all_reduce(ref)
        ref /= world * (M if divide_m else 1)
        reducer.reduce()
        got = torch.cat([p.grad.reshape(-1) for p in params])
        out.append((float((got - ref).abs().max() / ref.abs().max()), started_during, reducer.started_in_backward,
                    len(reducer.buckets)))
    return out


def test_buckets_start_in_the_last_backward_and_average_exactly():
    for divide_m in (False, True):  # pp: the reducer also takes the schedule's 1/m
        res = run_ranks(_worker, 2, 4096, divide_m)
        for rank_out in res:
            for err, started_during, started, n_buckets in rank_out:
                assert n_buckets >= 5
                assert err < 1e-6
                # nothing starts before the last microbatch; every bucket starts inside its backward
                assert started_during[:-1] == [0] * (M - 1)
                assert started_during[-1] == started == n_buckets


def test_one_bucket_by_default_on_a_small_model():
    res = run_ranks(_worker, 2, 25 * 2**20, False)
    assert all(o[0] < 1e-6 and o[3] == 1 and o[2] == 1 for r in res for o in r)
