"""EagerAdamW (issue #36): the same update as torch.optim.AdamW, bit for bit, without importing torch._dynamo."""
import os
import subprocess
import sys

import torch

from paralayer.runtime import optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(make, foreach: bool, steps: int = 4, reload: bool = False):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 5))
    g = torch.nn.Parameter(torch.randn(5))
    groups = optimizer.param_groups([w, g], weight_decay=0.1, decay_1d=False)
    opt = make(groups, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, foreach=foreach)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (w.sum(1) * g.sum()).pow(2).sum() + (torch.randn(8, 5, generator=gen) * w).sum()
        loss.backward()
        opt.step()
        if reload and i == 1:  # a checkpoint round trip in the middle
            sd = opt.state_dict()
            opt = make(optimizer.param_groups([w, g], 0.1, False), lr=1e-2, betas=(0.9, 0.95),
                       weight_decay=0.1, eps=1e-8, foreach=foreach)
            opt.load_state_dict(sd)
    return w.detach().clone(), g.detach().clone(), opt.state_dict()


def test_bit_identical_to_torch_adamw():
    for foreach in (True, False):
        for reload in (False, True):
            ref = _run(torch.optim.AdamW, foreach, reload=reload)
            got = _run(optimizer.EagerAdamW, foreach, reload=reload)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (foreach, reload)
            for k, st in ref[2]["state"].items():
                for name, v in st.items():
                    assert torch.equal(v, got[2]["state"][k][name]), (foreach, reload, k, name)
            assert ref[2]["param_groups"] == got[2]["param_groups"]
            assert not torch.equal(ref[0], _run(torch.optim.AdamW, foreach, steps=3)[0])  # the oracle can tell


def test_adamw_builder_uses_it():
    p = [torch.nn.Parameter(torch.randn(3, 3))]
    opt = optimizer.adamw(p, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    assert isinstance(opt, optimizer.EagerAdamW) and optimizer.implementation(opt) == "foreach"


def test_no_dynamo_import():
    code = """
import sys, torch
from paralayer.runtime import optimizer
p = torch.nn.Parameter(torch.randn(4, 4))
opt = optimizer.adamw([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
for _ in range(2):
    opt.zero_grad(); (p * p).sum().backward(); opt.step()
opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def _dtensor_steps(rank, world, which):
    """Three AdamW steps on DTensor parameters (a Shard(0) matrix, a Replicate gain) in a 2-rank mesh,
    by torch.optim.AdamW (DTensor dispatch: the oracle) or EagerAdamW (local shards); and a group
    whose gradient is Partial, which must not take the local path."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full_w, full_g = torch.randn(8, 5), torch.randn(5)
    w = torch.nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    g = torch.nn.Parameter(distribute_tensor(full_g, mesh, [Replicate()]))
    make = torch.optim.AdamW if which == "torch" else optimizer.EagerAdamW
    opt = make(optimizer.param_groups([w, g], 0.1, False), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
               eps=1e-8, foreach=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = (w.full_tensor().sum(1) * g.full_tensor().sum()).pow(2).sum() \
            + (torch.randn(8, 5, generator=gen) * w.full_tensor()).sum()
        loss.backward()
        opt.step()
    # a Partial gradient (ranks hold 1 and 2 of the sum 3): the first moment must be 0.1·3 on both
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    local = torch.full((4,), float(rank + 1))
    p.grad = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial()])
    opt2 = make([p], lr=1e-2, foreach=True)
    opt2.step()
    out = (w.full_tensor(), g.full_tensor(), p.full_tensor(), opt2.state[p]["exp_avg"].to_local(),
           opt.state[w]["exp_avg"].full_tensor(), opt.state[g]["exp_avg_sq"].full_tensor())
    dist.barrier()
    return [t.tolist() for t in out]


def test_local_shard_step_equals_the_dtensor_step():
    """EagerAdamW steps DTensor parameters on their local shards (optimizer.local_shards): the same
    weights and moments as torch's AdamW through DTensor dispatch, bit for bit; a Partial gradient
    keeps the DTensor path (its sum over ranks)."""
    from tests.dist import run_ranks

    ref = run_ranks(_dtensor_steps, 2, "torch", timeout_s=120)
    got = run_ranks(_dtensor_steps, 2, "eager", timeout_s=120)
    for rank in range(2):
        assert got[rank] == ref[rank], rank  # lists of floats: exact
    assert ref[0][2] != [1.0] * 4  # the Partial case stepped
    assert all(abs(x - 0.3) < 1e-6 for x in ref[0][3] + ref[1][3])  # (1 + 2)·(1 - β1) on both ranks


def test_local_shards_keeps_dtensors_when_placements_differ():
    from paralayer.runtime.optimizer import local_shards

    params, grads = [torch.zeros(2)], [torch.zeros(2)]
    assert local_shards(params, grads) == (params, grads)  # plain tensors: untouched
