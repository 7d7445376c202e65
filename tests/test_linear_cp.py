"""Context parallel for one Gated DeltaNet layer (paralayer/parallel/context/linear_state.py) against
the same layer on one process, at init std 0.2 (tests/test_gated_deltanet.py's transformers-drawn
weights): cp 2 and cp 3 (cp 3 has a middle rank, whose chunks take state from both sides), each
rank holding its zigzag shard of a 2-sequence batch of 96 tokens (chunks of 16 or 24 tokens against
the delta rule's 8-token chunks: several chunks per shard, and one padded).

- the output rows and the input's gradient rows of every rank, and every weight's gradient summed
  over the ranks, equal the one-process layer's within 1e-5 relative;
- the bytes each rank sent equal the resolver's count (paralayer/resolve/cost/cp_sends.py);
- planted: the conv tail not passed (each chunk's conv reads zeros before it), the recurrent state
  not passed (each chunk starts from zeros): both fail by over 100× the tolerance."""
from __future__ import annotations

import pytest
import torch

from paralayer.parallel.context import linear_state
from paralayer.parallel.context.zigzag import zigzag_shard
from tests.dist import run_ranks
from tests.test_gated_deltanet import DK, DV, HV, KERNEL, D, hf_layer, ours_from

TOL, SEQ, CHUNK = 1e-5, 96, 8


def _rel(got, want) -> float:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _no_tail(lo_last, hi_last, snake):
    """Planted: the conv's tail not passed (zeros before every chunk)."""
    return lo_last.new_zeros(lo_last.shape), hi_last.new_zeros(hi_last.shape)


def _no_state(q, k, v, g, beta, snake, chunk):
    """Planted: the recurrent state not passed (every chunk starts from zeros)."""
    from paralayer.model.linear.delta_rule import chunk_gated_delta_rule

    c = q.shape[1] // 2
    return torch.cat([chunk_gated_delta_rule(*(t[:, :c] for t in (q, k, v, g, beta)), chunk=chunk)[0],
                      chunk_gated_delta_rule(*(t[:, c:] for t in (q, k, v, g, beta)), chunk=chunk)[0]], dim=1)


def _layer():
    layer = ours_from(hf_layer())
    layer.chunk = CHUNK
    return layer


def _batch():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(5))


def _cp_worker(rank, world, plant):
    import torch.distributed as dist

    if plant == "tail_not_passed":
        linear_state._Tails.apply = _no_tail
    elif plant == "state_not_passed":
        linear_state.cp_delta_rule = _no_state
    layer = _layer()
    snake = linear_state.apply_linear_context_parallel(layer, dist.group.WORLD)
    x = zigzag_shard(_batch(), 1, world, rank).requires_grad_(True)
    y = layer(x)
    y.pow(2).sum().backward()
    return (y.detach().numpy(), x.grad.numpy(), {n: p.grad.numpy() for n, p in layer.named_parameters()},
            snake.sent_bytes)


def _reference():
    layer = _layer()
    x = _batch().requires_grad_(True)
    y = layer(x)
    # the ranks' losses are sums over their rows: their sum is the whole batch's
    y.pow(2).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _errors(world, res, reference) -> tuple[float, float, float]:
    y_ref, gx_ref, g_ref = reference
    y = max(_rel(torch.from_numpy(r[0]), zigzag_shard(y_ref, 1, world, i)) for i, r in enumerate(res))
    gx = max(_rel(torch.from_numpy(r[1]), zigzag_shard(gx_ref, 1, world, i)) for i, r in enumerate(res))
    gw = max(_rel(sum(torch.from_numpy(r[2][n]) for r in res), g_ref[n]) for n in g_ref)
    return y, gx, gw


@pytest.mark.parametrize("world", [2, 3])
def test_cp_layer_equals_one_process(reference, world):
    from paralayer.resolve.cost.cp_sends import rank_sends

    res = run_ranks(_cp_worker, world, None, timeout_s=300)
    y, gx, gw = _errors(world, res, reference)
    print(f"gated deltanet cp{world}: out {y:.1e}, dx {gx:.1e}, weight grads max {gw:.1e}")
    assert y < TOL and gx < TOL and gw < TOL, (y, gx, gw)
    channels, b = 2 * 2 * DK + HV * DV, 2
    state, tail = b * HV * DK * DV * 4, b * (KERNEL - 1) * channels * 4
    for r, out in enumerate(res):  # forward and backward: each state / tail message sent once each way
        n = rank_sends(world, r)
        assert out[3] == 2 * n * (state + tail), (r, out[3], n)


@pytest.mark.parametrize("plant", ["tail_not_passed", "state_not_passed"])
def test_planted_cp_errors_fail(reference, plant):
    res = run_ranks(_cp_worker, 2, plant, timeout_s=300)
    y, gx, gw = _errors(2, res, reference)
    print(f"gated deltanet cp2 planted {plant}: out {y:.1e}, dx {gx:.1e}, weight grads max {gw:.1e}")
    assert y > 100 * TOL and gw > 100 * TOL, (y, gx, gw)
