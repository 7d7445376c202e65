"""One-rank training step of our model vs Hugging Face transformers' LlamaForCausalLM.

Identical shapes, same process, same threads, fp32 on CPU: forward, backward and an AdamW step on
the same batch. The two are timed alternately (ABAB…) so machine noise hits both alike; we
report medians and the ratio of tokens/s (ours / transformers).

    python benchmarks/hf_compare.py [--threads 2] [--steps 12] [--d-model 512 --layers 4 ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paralayer.config import ModelConfig  # noqa: E402
from paralayer.model.transformer import Transformer, init_weights  # noqa: E402


def build_pair(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = Transformer(cfg)
    init_weights(ours, cfg, seed=0)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = LlamaForCausalLM(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    return ours, hf


def step_fn(model, opt, tokens, is_hf: bool, dtype: torch.dtype | None = None):
    def run():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            if is_hf:
                out = model(input_ids=tokens, labels=tokens)
                loss = out.loss
            else:
                # what runtime/train.py runs: labels shifted inside the sequence, the last position ignored
                labels = torch.full_like(tokens, -100)
                labels[:, :-1] = tokens[:, 1:]
                logits = model(tokens)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                         ignore_index=-100)
        loss.backward()
        opt.step()
        if tokens.device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16 = autocast, fp32 master weights")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      ffn_hidden=args.ffn, vocab_size=args.vocab, seq_len=args.seq)
    ours, hf = build_pair(cfg)
    device = torch.device(args.device)
    ours, hf = ours.to(device), hf.to(device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    assert n_ours == n_hf, (n_ours, n_hf)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen).to(device)
    runs = {
        "paralayer": step_fn(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4, foreach=True), tokens, False, dtype),
        "transformers": step_fn(hf, torch.optim.AdamW(hf.parameters(), lr=1e-4, foreach=True), tokens, True, dtype),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.warmup + args.steps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times[name].append(dt)
    tok = args.batch * cfg.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tok / v for k, v in med.items()}
    ratio = tps["paralayer"] / tps["transformers"]
    import transformers

    print(f"shape: d={cfg.d_model} L={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} ffn={cfg.ffn_hidden} "
          f"V={cfg.vocab_size} seq={cfg.seq_len} batch={args.batch}; {n_ours/1e6:.1f}M params; "
          f"threads={args.threads}; {args.device} {args.dtype}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("| model | median step (s) | tokens/s |")
    print("|---|---|---|")
    for k in runs:
        print(f"| {k} | {med[k]:.3f} | {tps[k]:,.0f} |")
    print(f"\nratio paralayer / transformers tokens/s: **{ratio:.3f}** (median of {args.steps} alternating steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
