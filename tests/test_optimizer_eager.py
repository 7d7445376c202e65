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
