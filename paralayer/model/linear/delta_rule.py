"""The gated delta rule (Yang et al., "Gated Delta Networks", 2024), in the chunked form that
transformers' ``torch_chunk_gated_delta_rule`` (models/qwen3_next, 5.25) writes, as a plain loop.

Per head, with a state S (dk × dv), a token t with key k, value v, query q, decay g <= 0 (log) and
write strength beta in (0, 1):

    S  <- exp(g) · S                          the gate, applied BEFORE the update
    S  <- S + beta · k (v - S^T k)^T          the delta rule: write what S does not yet predict
    o  =  S^T q

:func:`recurrent_gated_delta_rule` is that, token by token (the definition; tests compare the two).
:func:`chunk_gated_delta_rule` does the same in chunks of C tokens: inside a chunk the C updates are
one triangular solve (the UT transform) and a few matmuls; between chunks only S is carried. Both
take an ``initial_state`` and return the final one: context parallel passes it from rank to rank
(paralayer/parallel/context/linear_state.py). Everything in fp32 (transformers' fallback does the same)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|² + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta):
    """(b, s, h, d) / (b, s, h) → (b, h, s, d) / (b, h, s) in fp32 (fp64 stays fp64); k/q heads
    repeated to v's (each q/k head serves n_v / n_k consecutive value heads)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    dtype = torch.promote_types(v.dtype, torch.float32)
    return [x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v, beta, g)]


def next_state(state: torch.Tensor, chunk_decay: torch.Tensor, k_to_end: torch.Tensor,
               v_new: torch.Tensor) -> torch.Tensor:
    """The state after a chunk: the old state decayed over the whole chunk (the gates come first),
    plus each token's correction written with the decay from its position to the chunk's end.
    state (B, dk, dv), chunk_decay (B, 1, 1), k_to_end (B, C, dk), v_new (B, C, dv)."""
    return state * chunk_decay + torch.bmm(k_to_end.transpose(-1, -2), v_new)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk: int = 64,
                           initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (b, s, hk, dk) (already l2-normed); v: (b, s, hv, dv); g, beta: (b, s, hv).
    Returns (out (b, s, hv, dv) in q's dtype, final state (b, hv, dk, dv) fp32). q is scaled by dk^-0.5."""
    dtype, s = q.dtype, q.shape[1]
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    b, h, _, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    pad = (chunk - s % chunk) % chunk  # zero tokens at the end: g = 0, beta = 0 (they change nothing)
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (s + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(b, h, n, chunk), g.reshape(b, h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay_ij = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # UT transform: (I + A) u = beta v with A_ij = beta_i k_i·k_j decay_ij (j < i) — A's diagonal
    # is replaced by the unit one of solve_triangular(unitriangular=True)
    a = (k_beta @ k.transpose(-1, -2)) * decay_ij
    u = torch.linalg.solve_triangular(a, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay_ij  # within a chunk, causal (the diagonal included)
    q_from_start = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    # the recurrence over chunks, the only sequential part: per chunk four GEMMs batched over
    # (b·h) (bmm: a 4-D matmul adds its expand and views), on views of the tensors above (unbind:
    # one op for all chunks, and one stack in backward, where indexing each chunk would cost a
    # select and a full-size select_backward per chunk). Not baddbmm: under autocast it would cast
    # the fp32 addend to bf16 too, where the sums here stay fp32 as transformers' are
    bh = b * h

    def chunks(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.reshape(bh, n, x.shape[-2], x.shape[-1]).unbind(1)

    u_c, w_c, attn_c, q_c, k_c, decay_c = (chunks(x) for x in (u, w, attn, q_from_start, k_to_end, chunk_decay))
    state = (torch.zeros(bh, dk, dv, device=q.device, dtype=q.dtype) if initial_state is None
             else initial_state.to(q.dtype).reshape(bh, dk, dv))
    outs = []
    for i in range(n):
        v_new = u_c[i] - torch.bmm(w_c[i], state)  # what the carried state does not already predict
        outs.append(torch.bmm(q_c[i], state) + torch.bmm(attn_c[i], v_new))
        state = next_state(state, decay_c[i], k_c[i], v_new)
    out = torch.stack(outs, dim=1).reshape(b, h, n * chunk, dv)[:, :, :s]
    state = state.reshape(b, h, dk, dv)
    return out.transpose(1, 2).contiguous().to(dtype), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one token at a time (same arguments and results as the chunked form)."""
    dtype = q.dtype
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    b, h, s, dk = k.shape
    q = q * dk ** -0.5
    state = (torch.zeros(b, h, dk, v.shape[-1], device=q.device, dtype=q.dtype) if initial_state is None
             else initial_state.to(q.dtype))
    outs = []
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = (v[:, :, t] - (state * kt[..., None]).sum(-2)) * beta[:, :, t, None]
        state = state + kt[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(dtype), state
