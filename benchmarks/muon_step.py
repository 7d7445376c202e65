"""The optimizer step of Muon against AdamW on one machine (issue #47 item 5).

One process builds a Llama-style model (ours, fp32, on this machine's device), gives every
parameter a random gradient, and times ``opt.step()`` of the runtime's AdamW (foreach on CPU, fused
on CUDA) and of its Muon (``train.optimizer=muon``: Newton-Schulz on the blocks' matrices, AdamW on
the rest; fp32 iteration on CPU, bf16 on CUDA): the median of ``--steps`` timed steps after 2
warm-up steps, and their ratio. It also times the Newton-Schulz that ONE owner runs when the
matrices are dealt over ``--dp`` data ranks (paralayer/optim/owners.py's balanced assignment): the
share of the step that owners divide.

    python benchmarks/muon_step.py [--d-model 512] [--layers 4] [--ffn 1408] [--vocab 8192] [--steps 10] [--dp 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args):
    from paralayer.config import ModelConfig
    from paralayer.model.transformer import Transformer, init_weights

    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                      ffn_hidden=args.ffn, vocab_size=args.vocab, seq_len=128)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    init_weights(model, cfg, 0, device)
    g = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    return model, device


def median_step(opt, steps: int, device) -> float:
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from paralayer.optim import owners
    from paralayer.optim.muon import DataGroup, MatrixExchange, newton_schulz, split_params
    from paralayer.runtime.optimizer import MuonAdamW, adamw

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, device = build(args)
    params = list(model.parameters())
    fused = device.type == "cuda"
    dtype = torch.bfloat16 if fused else torch.float32
    muon, adam = split_params(model.named_parameters())
    t_adam = median_step(adamw(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused), args.steps, device)
    opt = MuonAdamW(muon, adam, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, decay_1d=False,
                    muon_lr=1e-4, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr="match_rms_adamw",
                    exchange=MatrixExchange(DataGroup(None), 5, dtype), fused=fused)
    t_muon = median_step(opt, args.steps, device)
    # the Newton-Schulz alone, all matrices and one owner's share of them over --dp ranks
    costs = [owners.ns_cost(p.shape) for p in muon]
    mine = [p for p, o in zip(muon, owners.assign_owners(costs, args.dp)) if o == 0]

    class NS:
        def __init__(self, ps):
            self.ps = ps

        def step(self):
            for p in self.ps:
                newton_schulz(p.grad, 5, dtype=dtype)

    t_ns_all = median_step(NS(muon), args.steps, device)
    t_ns_owner = median_step(NS(mine), args.steps, device)
    n_muon, n_all = sum(p.numel() for p in muon), sum(p.numel() for p in params)
    print(f"device {device.type} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
          f"model d={args.d_model} "
          f"L={args.layers} ffn={args.ffn} vocab={args.vocab}: {n_all / 1e6:.1f}M params, {n_muon / 1e6:.1f}M on Muon "
          f"({len(muon)} matrices); median of {args.steps} steps")
    print(f"AdamW step   {t_adam * 1e3:9.2f} ms")
    print(f"Muon step    {t_muon * 1e3:9.2f} ms   ({t_muon / t_adam:.2f}x AdamW)")
    print(f"  Newton-Schulz, every matrix          {t_ns_all * 1e3:9.2f} ms")
    print(f"  Newton-Schulz, one owner of dp={args.dp}      {t_ns_owner * 1e3:9.2f} ms   "
          f"(cost share {owners.loads(costs, owners.assign_owners(costs, args.dp), args.dp)[0] / sum(costs):.3f})")


if __name__ == "__main__":
    main()
