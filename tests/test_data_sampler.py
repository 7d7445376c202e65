"""The O(1)-memory sampler: a seeded Feistel bijection of [0, N) per epoch, a pure function of
(seed, epoch, index); the global batch of a step is the same from any dp size and after any resume."""
from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from paralayer.data.sampler import global_batch_indices, permute, rank_share


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2 ** 63 - 1), epoch=st.integers(0, 10 ** 6))
def test_permute_is_a_bijection(n, seed, epoch):
    p = permute(np.arange(n), n, seed, epoch)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(n))
    # pure: the same indices in another order or alone map the same way
    idx = np.random.default_rng(0).permutation(n)[: min(n, 50)]
    np.testing.assert_array_equal(permute(idx, n, seed, epoch), p[idx])


def test_permute_mixes_and_costs_no_memory():
    n = 10_007
    p0, p1 = permute(np.arange(n), n, 1, 0), permute(np.arange(n), n, 1, 1)
    assert (p0 != p1).mean() > 0.99 and (p0 != np.arange(n)).mean() > 0.99
    assert (permute(np.arange(n), n, 2, 0) != p0).mean() > 0.99
    # neighbours scatter: the positions of 0..99 are spread over the whole range
    assert np.std(p0[:100]) > n / 5
    # 1.9 billion sequences (15.6T tokens at seq 8192): a batch of 1024 costs kilobytes, not 15 GB
    big = 1_900_000_000
    tracemalloc.start()
    x = permute(np.arange(5 * 10 ** 8, 5 * 10 ** 8 + 1024), big, 7, 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2_000_000 and len(set(x.tolist())) == 1024 and 0 <= x.min() and x.max() < big


def test_resume_is_the_step_mid_epoch_and_across_epochs():
    n, B = 37, 8  # epoch boundaries fall inside steps 5, 10, ...
    stream = sum((global_batch_indices(k, B, n, True, 11) for k in range(1, 21)), [])
    for e in range(4):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    # a "resumed" process asks for step k cold and gets the straight run's batch
    for k in (3, 5, 6, 14):
        assert global_batch_indices(k, B, n, True, 11) == stream[(k - 1) * B:k * B]
    for dp in (1, 2, 4, 8):
        g = global_batch_indices(5, B, n, True, 11)
        assert sum((rank_share(g, r, dp) for r in range(dp)), []) == g
