"""QK-clip (Kimi K2's MuonClip, arXiv 2507.20534 §2.1): after Muon's step, every attention head whose
largest pre-softmax logit of the step passed ``tau`` has its query and key weights scaled down so
that the logit would have been ``tau``.

    S_max^h = max over the step's batch of scale · q_i^h·k_j^h      (paralayer/model/max_logit.py)
    γ_h     = τ / S_max^h where S_max^h > τ, else 1 (the head is left alone)

    MHA / GQA:  W_q^h ← W_q^h · √γ,  W_k^h ← W_k^h · √γ          (q·k scales by γ)
    MLA:        W_q^h nope rows (q_b or wq) ← · √γ_h,  W_k^h nope rows (kv_b) ← · √γ_h,
                W_q^h rope rows ← · γ_h,  the shared rope key (kv_a) untouched, v untouched

GQA: a key head serves ``n_heads / n_kv_heads`` query heads, so one γ per group, that of the group's
largest logit (γ_g = min over the group's heads), applied to the group's query heads and its key
head as √γ_g each. This is Megatron-Core's rule for grouped attention (``SelfAttention.clip_qk``:
the max of ``current_max_attn_logits`` viewed as (groups, heads per group), ``qk_clip_alpha`` 0.5);
every head of the group then ends at or below τ, none above. MHA is the case of groups of one,
which is Kimi's per-head rule exactly. Biases (GPT-OSS's q/k biases) scale with their rows, so that
q and k themselves scale by √γ.

Distributed: the maxima are all-reduced (MAX) over dp·cp (every data rank saw other sequences,
every context rank other queries, against the whole sequence's keys: model/max_logit.py;
pipeline microbatches already met in the running max) and over tp (each tp rank measured its
own heads; the others' are −inf), so every rank holds every head's S_max of the layers of its
stage. Each rank then scales ITS part of each weight, whatever parallelism made it: the per-row
factor vector is laid out with the weight's placements (tp's head rows, FSDP's row shards,
both strided) without communication; replicas (ZeRO 0/1) all scale their copy identically.
Muon's momentum is not touched (Kimi's Algorithm 1 rescales the weights only).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from paralayer.model.attention import Attention
from paralayer.model.latent_attention import LatentAttention
from paralayer.model.max_logit import ContextShards, MaxLogit


def attention_modules(chunks: Sequence[nn.Module]) -> list[nn.Module]:
    """Every softmax attention of this rank's chunks (MTP's blocks included), in module order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, (Attention, LatentAttention))]


def head_gammas(s_max: torch.Tensor, tau: float, n_kv_heads: Optional[int] = None) -> torch.Tensor:
    """(heads,) γ from (heads,) maxima: τ/S where S > τ, else 1; with ``n_kv_heads`` < heads, the
    group's smallest γ for each of its query heads (GQA)."""
    gamma = torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))
    if n_kv_heads is not None and n_kv_heads < gamma.numel():
        rep = gamma.numel() // n_kv_heads
        gamma = gamma.view(n_kv_heads, rep).amin(dim=1).repeat_interleave(rep)
    return gamma


def _per_row(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Rows of one head laid out from (rows, factor) parts, for every head: (heads·Σrows,)."""
    return torch.cat([f.unsqueeze(1).expand(-1, n) for n, f in parts], dim=1).reshape(-1)


def row_factors(att: nn.Module, gamma: torch.Tensor, n_kv_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, factor of each of its global rows) for the weights QK-clip scales in ``att``;
    ``gamma``: (n_heads,) per query head (already grouped for GQA)."""
    ones = torch.ones_like(gamma)
    if isinstance(att, LatentAttention):
        root = gamma.sqrt()
        q = _per_row([(att.nope, root), (att.rope, gamma)])
        kv = _per_row([(att.nope, root), (att.v_dim, ones)])
        return [(att.wq.weight if att.wq is not None else att.q_b.weight, q), (att.kv_b.weight, kv)]
    hd, rep = att.head_dim, gamma.numel() // n_kv_heads
    root = gamma.sqrt()
    q = _per_row([(hd, root), (hd, ones)] if att.gated else [(hd, root)])  # gated: [q | gate] per head
    k = _per_row([(hd, root[::rep])])
    out = [(att.wq.weight, q), (att.wk.weight, k)]
    if att.wq.bias is not None:
        out += [(att.wq.bias, q), (att.wk.bias, k)]
    return out


def scale_rows(p: torch.Tensor, factor: torch.Tensor) -> None:
    """In place: row r of ``p`` (its global index) times ``factor[r]``, on this rank's part of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from paralayer.parallel.local_shard import local_tensor

    if isinstance(p, DTensor):  # the rows this rank holds, however the placements deal them
        factor = distribute_tensor(factor, p.device_mesh, p.placements, src_data_rank=None).to_local()
    w = local_tensor(p.data)
    w.mul_(factor.to(device=w.device, dtype=w.dtype).view(-1, *[1] * (w.dim() - 1)))


class QKClip:
    """The step's maxima of every attention of this rank, and the rescale after the optimizer step.
    ``groups``: the process groups the maxima are reduced over (dp·cp, tp; None where size 1)."""

    def __init__(self, modules: list[nn.Module], tau: float, n_heads: int, n_kv_heads: int, tp: int,
                 tp_rank: int, groups: list, device: torch.device, cp: Optional[ContextShards] = None):
        self.modules, self.tau, self.n_heads, self.groups = modules, float(tau), n_heads, groups
        self.n_kv = {id(m): (n_heads if isinstance(m, LatentAttention) else n_kv_heads) for m in modules}
        self.local = n_heads // tp
        self.offset = tp_rank * self.local
        for m in modules:
            m.max_logit = MaxLogit(self.local, device, cp)
        self.last: dict = {}

    def reset(self) -> None:
        for m in self.modules:
            m.max_logit.reset()

    def maxima(self) -> torch.Tensor:
        """(modules, n_heads): every head's S_max this step, the same on every rank of the groups."""
        if not self.modules:
            return torch.empty(0, self.n_heads)
        s = torch.full((len(self.modules), self.n_heads), float("-inf"), device=self.modules[0].max_logit.value.device)
        for i, m in enumerate(self.modules):
            s[i, self.offset: self.offset + self.local] = m.max_logit.value
        for g in self.groups:
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=g)
        return s.cpu()

    @torch.no_grad()
    def after_step(self) -> dict:
        """Rescale the heads over τ; returns this stage's ``max_logit`` (before) and the number of
        query heads rescaled (``qk_clipped_heads``), kept in ``last``."""
        s = self.maxima()
        clipped = 0
        for m, s_m in zip(self.modules, s):
            gamma = head_gammas(s_m, self.tau, self.n_kv[id(m)])
            if bool((gamma < 1).any()):
                clipped += int((gamma < 1).sum())
                for p, f in row_factors(m, gamma, self.n_kv[id(m)]):
                    scale_rows(p, f)
        self.last = {"max_logit": float(s.max()) if s.numel() else float("-inf"), "qk_clipped_heads": clipped}
        return self.last


def build(cfg, built, meshes) -> Optional[QKClip]:
    """The runtime's QK-clip (``train.muon.qk_clip_tau`` set), or None (off: nothing is recorded)."""
    tau = cfg.train.muon.qk_clip_tau
    if tau is None:
        return None
    groups = [meshes[a].get_group() for a in ("dp_cp", "tp") if meshes.size(a) > 1]
    m, cp = cfg.model, meshes.size("cp")
    shards = None
    if cp > 1:  # the queries of this rank's zigzag chunks against every rank's keys
        from paralayer.parallel.context.zigzag import zigzag_indices

        shards = ContextShards(meshes["cp"].get_group(), cp, zigzag_indices(m.seq_len, cp, meshes.local_rank("cp")),
                               torch.cat([zigzag_indices(m.seq_len, cp, r) for r in range(cp)]))
    return QKClip(attention_modules(built.chunks), tau, m.n_heads, m.n_kv_heads, meshes.size("tp"),
                  meshes.local_rank("tp"), groups, built.device, shards)


def step_stats(clip: Optional[QKClip], meshes, pp: int) -> dict:
    """metrics.jsonl's ``max_logit`` and ``qk_clipped_heads`` over every stage (identical on every rank)."""
    if clip is None:
        return {}
    dev = clip.modules[0].max_logit.value.device if clip.modules else torch.device("cpu")
    top = torch.tensor([clip.last.get("max_logit", float("-inf"))], dtype=torch.float64, device=dev)
    count = torch.tensor([clip.last.get("qk_clipped_heads", 0)], dtype=torch.float64, device=dev)
    if pp > 1:  # stages hold different layers
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=meshes["pp"].get_group())
        dist.all_reduce(count, group=meshes["pp"].get_group())
    return {"max_logit": float(top), "qk_clipped_heads": int(count)}
