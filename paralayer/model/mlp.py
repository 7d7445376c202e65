"""The dense feed-forward part: SwiGLU, w2(silu(w1 x) * w3 x) (Llama, Mistral, Qwen3), or GeGLU,
w2(gelu_tanh(w1 x) * w3 x) (Gemma 3: transformers' gelu_pytorch_tanh): the same three GEMMs, and
the same tensors kept for backward (gate and up)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.model.recompute import recompute


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); ``act="gelu_tanh"``: GeGLU."""

    def __init__(self, d_model: int, hidden: int, act: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.recompute_act = False
        self.tp_overlap = None  # as Attention.tp_overlap
        self.act_fn = GLU_ACTS[act]  # compiled in place under train.compile with tp (model/compile.py)

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


def _geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


#: model.mlp_act → the gated activation
GLU_ACTS = {"silu": _swiglu, "gelu_tanh": _geglu}
