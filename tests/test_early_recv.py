"""parallel/pipeline/early_recv.py: gpipe/1f1b post every receive but the first one ahead of the action
that needs it, send without waiting, and train exactly as torch's schedule alone does."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks


def _step(rank, world, schedule, m):
    import torch.distributed as dist

    from paralayer.config import ModelConfig
    from paralayer.model.transformer import Transformer, init_weights, lm_loss
    from paralayer.parallel import pipeline as pl
    from paralayer.parallel.pipeline import early_recv as er
    from paralayer.parallel.pipeline import runner as plr  # where PipelineRunner looks EarlyRecv up

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, seq_len=16,
                      init_std=0.2)
    plan = {"degrees": {"pp": world, "vpp": 1}, "microbatches": m, "schedule": schedule,
            "stage_layers": pl.default_stage_layers(cfg.n_layers, world, 1, schedule)}
    seq = torch.randint(0, cfg.vocab_size, (2 * m, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for early in (False, True):
        with torch.device("meta"):
            model = Transformer(cfg)
        chunks = pl.split_model(model, plan, rank)
        for c in chunks:
            c.to_empty(device="cpu")
            init_weights(c, cfg, 0)
        posted = {"early": 0, "schedule": 0}
        real = er.EarlyRecv

        class Counting(real):
            def _post_next(self):
                before = len(self.early)
                super()._post_next()
                posted["early"] += len(self.early) - before  # noqa: B023 - used within this iteration

            def _getter(self, kind):
                get = super()._getter(kind)

                def counted(mb):
                    ops = get(mb)
                    posted["schedule"] += bool(ops)  # noqa: B023
                    return ops
                return counted

        plr.EarlyRecv = Counting if early else (lambda stage, n: None)
        try:
            runner = pl.PipelineRunner(chunks, dist.group.WORLD, plan, lambda lg, lb: lm_loss(lg, lb, cfg.vocab_size))
        finally:
            plr.EarlyRecv = real
        loss = runner.step(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        grads = torch.cat([p.grad.flatten() for c in chunks for p in c.parameters()])
        out[early] = (float(loss), grads.tolist(), posted)
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_early_receives_same_step(schedule):
    m = 4
    for rank, out in enumerate(run_ranks(_step, 2, schedule, m)):
        loss0, grads0, _ = out[False]
        loss1, grads1, posted = out[True]
        assert loss0 == loss1 and grads0 == grads1  # the same arithmetic, only the P2P timing moved
        # stage 0 receives m grads, stage 1 m activations: all posted early but stage 1's first
        expected_early = m if rank == 0 else m - 1
        assert posted == {"early": expected_early, "schedule": m - expected_early}, (rank, posted)
