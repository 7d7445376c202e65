"""The dense feed-forward part: SwiGLU, w2(silu(w1 x) * w3 x) (Llama, Mistral, Qwen3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.model.recompute import recompute


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.recompute_act = False
        self.tp_overlap = None  # as Attention.tp_overlap
        self.act_fn = _swiglu  # compiled in place under train.compile with tp (model/compile.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_overlap is not None:
            gate, up = self.tp_overlap.gather_matmul(x, (self.w1.weight, self.w3.weight))
        else:
            gate, up = self.w1(x), self.w3(x)
        if self.recompute_act:
            act = recompute(self.act_fn, gate, up)
        else:
            act = self.act_fn(gate, up)
        if self.tp_overlap is not None:
            return self.tp_overlap.matmul_scatter(act, self.w2.weight)
        return self.w2(act)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
