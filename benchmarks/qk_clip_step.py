"""What QK-clip (``train.muon.qk_clip_tau``, paralayer/optim/qk_clip.py) costs on one machine.

One process builds our Llama-style model (fp32 on CPU, the device's own on CUDA) and times a
training forward+backward on random tokens without and with the max-logit recorders
(paralayer/model/max_logit.py: one extra no-grad q·kᵀ per layer), then the rescale after a step
(``QKClip.after_step`` with every head over τ, so every W_q/W_k row is scaled): medians of
``--steps`` timed repetitions after 2 warm-ups, alternating the two so that a busy machine slows both.

    python benchmarks/qk_clip_step.py [--d-model 512] [--layers 4] [--heads 8] [--seq 1024] [--batch 2] [--steps 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def build(args):
    from paralayer.config import ModelConfig
    from paralayer.model.transformer import Transformer, init_weights

    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.heads // 2,
                      ffn_hidden=args.d_model * 11 // 4, vocab_size=args.vocab, seq_len=args.seq, init_std=0.2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    init_weights(model, cfg, 0, device)
    return model, cfg, device


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from paralayer.optim.qk_clip import QKClip, attention_modules

    model, cfg, device = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    mods = attention_modules([model])

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()

    clip = QKClip(mods, 1.0, cfg.n_heads, cfg.n_kv_heads, 1, 0, [], device)
    recorders = [m.max_logit for m in mods]
    times = {"off": [], "on": [], "rescale": []}
    for i in range(args.steps + 2):
        for m in mods:
            m.max_logit = None
        off = timed(fwd_bwd, device)
        for m, r in zip(mods, recorders):
            m.max_logit = r
        clip.reset()
        on = timed(fwd_bwd, device)
        for r in recorders:  # every head far over tau (the weights shrink each time; the work is the same)
            r.value.fill_(1e4)
        with torch.no_grad():
            rescale = timed(clip.after_step, device)
        if i >= 2:
            times["off"].append(off)
            times["on"].append(on)
            times["rescale"].append(rescale)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: d {args.d_model}, {args.layers} layers, {args.heads} heads ({args.heads // 2} kv), seq {args.seq}, "
          f"batch {args.batch}, {device.type}, {torch.get_num_threads()} threads; {clip.last['qk_clipped_heads']} "
          f"heads rescaled per step")
    print(f"forward+backward without QK-clip: {med['off'] * 1e3:.1f} ms")
    extra = (med["on"] / med["off"] - 1) * 100
    print(f"forward+backward with the max logits: {med['on'] * 1e3:.1f} ms ({extra:+.1f}%)")
    print(f"the rescale after the step (every head): {med['rescale'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
