"""paralayer/compat.py: every private torch API is present on this torch, a missing one fails
with a message naming the API and the torch version, and the fallbacks for APIs newer than
torch 2.11 give the same result as the new API."""
from __future__ import annotations

import pytest
import torch

from paralayer import compat
from tests.dist import run_ranks


def test_every_private_api_is_present():
    assert compat.check() == []
    assert compat.torch_version() >= (2, 11)


def test_missing_private_api_names_it_and_the_torch_version(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(compat.CompatError) as e:
        compat.in_backward()
    msg = str(e.value)
    assert "torch._C._current_graph_task_id" in msg and torch.__version__ in msg
    assert "torch._C._current_graph_task_id" in compat.check()


def test_missing_stage_action_is_reported():
    class Stage:  # a pipeline stage of a torch whose per-action methods were renamed
        def forward_one_chunk(self):
            pass

    with pytest.raises(compat.CompatError, match="backward_one_chunk"):
        compat.stage_action_methods(Stage())


def _gather_both(rank, world):
    import torch.distributed as dist

    mine = torch.tensor([rank + 1.0, 10.0 * rank])
    new, old = torch.zeros(2 * world), torch.zeros(2 * world)
    compat.all_gather_single(new, mine)                                   # this torch's API
    compat.all_gather_single(old, mine, _api=dist.all_gather_into_tensor)  # what torch 2.11 runs
    return new.tolist(), old.tolist()


def test_all_gather_single_fallback_matches():
    for new, old in run_ranks(_gather_both, 2):
        assert new == old == [1.0, 0.0, 2.0, 10.0]


def test_fallback_used_when_the_new_api_is_absent(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group=None: calls.append(group))
    compat.all_gather_single(torch.zeros(2), torch.zeros(1), group="g")
    assert calls == ["g"]
