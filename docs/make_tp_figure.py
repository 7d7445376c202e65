"""Draw docs/tp-layout.png: which rank holds which slice of each weight under tp=2 (+ SP).

    python docs/make_tp_figure.py [--out docs/tp-layout.png]

Each weight is drawn in nn.Linear's (out_features, in_features) orientation, i.e. the matrix the
layer multiplies by, transposed: "colwise" (Megatron's column split of A = Wᵀ) cuts the OUTPUT rows
of W, "rowwise" cuts the INPUT columns of W. Rank 0 blue, rank 1 orange.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

C = ["#4C72B0", "#DD8452"]  # rank 0, rank 1
GREY = "#BBBBBB"


def matrix(ax, x, y, w, h, split, title, sub, parts=2, labels=None):
    """A weight of size w×h at (x, y); split 'rows' (horizontal bands) or 'cols' (vertical)."""
    for i in range(parts):
        r = i % 2
        if split == "rows":
            rect = Rectangle((x, y + h - (i + 1) * h / parts), w, h / parts, fc=C[r], ec="white", lw=1.5)
        else:
            rect = Rectangle((x + i * w / parts, y), w / parts, h, fc=C[r], ec="white", lw=1.5)
        ax.add_patch(rect)
        if labels:
            cx = x + w / 2 if split == "rows" else x + (i + 0.5) * w / parts
            cy = y + h - (i + 0.5) * h / parts if split == "rows" else y + h / 2
            ax.text(cx, cy, labels[i], ha="center", va="center", fontsize=7.5, color="white", weight="bold")
    ax.text(x + w / 2, y + h + 0.12, title, ha="center", va="bottom", fontsize=9.5, weight="bold")
    ax.text(x + w / 2, y - 0.1, sub, ha="center", va="top", fontsize=7.5, color="#333333")


def seq_bar(ax, x, y, w, h, title, sp=True):
    """An activation (b, s, h) drawn as s along x: SP splits it into tp chunks of the sequence."""
    if sp:
        for i in range(2):
            ax.add_patch(Rectangle((x + i * w / 2, y), w / 2, h, fc=C[i], ec="white", lw=1.5))
            ax.text(x + (i + 0.5) * w / 2, y + h / 2, f"s {i * 8}–{i * 8 + 7}", ha="center",
                    va="center", fontsize=7, color="white", weight="bold")
    else:
        ax.add_patch(Rectangle((x, y), w, h, fc=GREY, ec="white"))
    ax.text(x + w / 2, y + h + 0.08, title, ha="center", va="bottom", fontsize=8.5)


def arrow(ax, x0, y0, x1, y1, text=None):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=10, lw=1, color="#444444"))
    if text:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.08, text, ha="center", va="bottom", fontsize=7, color="#8B0000",
                style="italic")


def main(out: str) -> None:
    fig, ax = plt.subplots(figsize=(15, 8.8))
    ax.set_xlim(0, 15)
    ax.set_ylim(0, 8.8)
    ax.axis("off")
    ax.text(7.5, 8.55, "Tensor parallel, tp = 2, sequence parallel on (example: 4 query heads, 2 KV heads, "
            "vocab 257 padded to 258, ffn 96, seq 16)", ha="center", fontsize=12, weight="bold")
    ax.add_patch(Rectangle((0.3, 8.05), 0.3, 0.22, fc=C[0]))
    ax.text(0.68, 8.16, "rank 0", va="center", fontsize=9)
    ax.add_patch(Rectangle((1.5, 8.05), 0.3, 0.22, fc=C[1]))
    ax.text(1.88, 8.16, "rank 1", va="center", fontsize=9)
    ax.add_patch(Rectangle((2.7, 8.05), 0.3, 0.22, fc=GREY))
    ax.text(3.08, 8.16, "whole on every rank", va="center", fontsize=9)
    ax.text(5.3, 8.16, "weights drawn as nn.Linear.weight (out × in): colwise = split the out rows, "
            "rowwise = split the in columns", va="center", fontsize=8.5, color="#333333")

    # --- row 1: embedding, attention
    y = 5.2
    matrix(ax, 0.4, y, 1.1, 2.2, "rows", "tok_embeddings", "RowwiseParallel\nvocab rows 0–128 | 129–256 + 1 pad row\n"
           "out: reduce-scatter → Shard(1)", labels=["ids 0–128", "ids 129–256\n+ pad"])
    seq_bar(ax, 2.0, 6.1, 1.6, 0.45, "attention_norm (SP)")
    arrow(ax, 3.7, 6.32, 4.3, 6.32, "all-gather")
    matrix(ax, 4.4, y, 1.0, 2.2, "rows", "wq", "Colwise\nq heads 0,1 | 2,3", labels=["h0 h1", "h2 h3"])
    matrix(ax, 5.7, y + 0.55, 1.0, 1.1, "rows", "wk", "Colwise\nkv head 0 | 1", labels=["kv0", "kv1"])
    matrix(ax, 7.0, y + 0.55, 1.0, 1.1, "rows", "wv", "Colwise\nkv head 0 | 1", labels=["kv0", "kv1"])
    ax.text(7.5, y + 2.45, "", ha="center")
    arrow(ax, 8.1, 6.32, 8.6, 6.32, "attn\n(local heads)")
    matrix(ax, 8.7, y, 2.2, 1.0, "cols", "wo", "Rowwise: in columns = heads 0,1 | 2,3\n"
           "partial sums → reduce-scatter → Shard(1)", labels=["h0 h1", "h2 h3"])
    seq_bar(ax, 11.5, 6.1, 1.6, 0.45, "residual stream (SP)")
    ax.text(13.3, 6.3, "+ x", fontsize=9, va="center")

    # --- row 2: MLP, final norm, output
    y = 1.5
    seq_bar(ax, 0.4, 2.5, 1.6, 0.45, "ffn_norm (SP)")
    arrow(ax, 2.1, 2.72, 2.7, 2.72, "all-gather")
    matrix(ax, 2.8, y, 1.0, 2.4, "rows", "w1 (gate)", "Colwise\nunits 0–47 | 48–95",
           labels=["f 0–47", "f 48–95"])
    matrix(ax, 4.2, y, 1.0, 2.4, "rows", "w3 (up)", "Colwise\nsame units", labels=["f 0–47", "f 48–95"])
    arrow(ax, 5.2, 2.72, 5.9, 2.72, "silu(g)·u\nlocal, exact")
    matrix(ax, 6.0, y + 0.7, 2.4, 1.0, "cols", "w2 (down)", "Rowwise: in columns = the same units\n"
           "partial sums → reduce-scatter", labels=["f 0–47", "f 48–95"])
    seq_bar(ax, 9.0, 2.5, 1.6, 0.45, "final norm (SP)")
    arrow(ax, 10.7, 2.72, 11.2, 2.72, "all-gather")
    matrix(ax, 11.3, y, 1.1, 2.4, "rows", "output", "Colwise, logits stay Shard(-1)\n"
           "vocab 0–128 | 129–256 + pad", labels=["v 0–128", "v 129–256\n+ pad"])
    arrow(ax, 12.5, 2.72, 13.0, 2.72)
    ax.text(13.05, 2.72, "loss_parallel\ncross-entropy:\nmax / sum-exp\nall-reduced,\nfull logits never\n"
            "gathered; the pad\ncolumn gets −1e9", va="center", fontsize=7.5)
    ax.text(7.5, 0.35, "Without SP the norms (grey, whole sequence) are replicated and each reduce-scatter + "
            "all-gather pair becomes one all-reduce. Per layer: 2 all-reduces forward, 2 backward "
            "(SP: 2 all-gathers + 2 reduce-scatters each way).", ha="center", fontsize=8.5, color="#333333")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).with_name("tp-layout.png")))
    main(ap.parse_args().out)
