"""Muon's optimizer states (``train.optimizer=muon``): one fp32 momentum buffer per parameter it
steps, in place of AdamW's two moments; AdamW's two stay for the parameters it keeps.

Which parameters Muon steps is paralayer/optim/muon.py's rule (``uses_muon``): every matrix of the
blocks and the experts; AdamW keeps the norm gains (the layer's, the attention's inner, the final,
MTP's), the token embedding and the output head (and MTP's copy of the embedding under pp). The
momentum is sharded as AdamW's moments are (ZeRO ≥ 1 over dp·cp, experts over expert-dp), so the
Muon share of the optimizer bytes is half of what :func:`states.state_bytes` gives for it. Under
ZeRO-1 the runtime deals whole parameters by size, not by kind: the plan takes a share's Muon
fraction as the rank's (exact only on average over the data ranks).

QK-clip (``train.muon.qk_clip_tau``, MuonClip) keeps one more state, counted with the optimizer's:
each softmax attention of the rank's chunks (MTP's blocks too; not a Gated DeltaNet layer) holds the
step's running max logit of its heads (paralayer/model/max_logit.py ``MaxLogit.value``), one fp32
per local head — n_heads/tp under tp, whole on every data, context and expert rank (neither ZeRO nor
FSDP shards it): :func:`qk_clip_bytes`. The (layers, n_heads) tensor its all-reduce forms after the
optimizer step is transient and not counted.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.states import rank_chunks, rank_layers, rank_params, state_bytes
from paralayer.resolve.rules import Layout

#: Muon's held state bytes over AdamW's, per parameter: one fp32 buffer (4 B) against m and v (8 B)
MUON_STATE_RATIO = 0.5


def qk_clip_bytes(cfg: Config, lay: Layout, r: int) -> int:
    """QK-clip's max-logit buffers on pipeline rank r (module docstring): 4 bytes per local head per
    softmax attention it runs; 0 when QK-clip is off."""
    if getattr(cfg.train.muon, "qk_clip_tau", None) is None:
        return 0
    n_attn = sum(1 for i in rank_layers(cfg, lay, r) if not parts.is_linear_layer(cfg, i))
    return 4 * (cfg.model.n_heads // lay.tp) * n_attn


def muon_split(cfg: Config, lay: Layout, r: int) -> tuple:
    """(dense, expert) parameters Muon steps on pipeline rank r, and QK-clip's buffer bytes
    (:func:`qk_clip_bytes`); () under AdamW."""
    if getattr(cfg.train, "optimizer", "adamw") != "muon":
        return ()
    # the matrices optim/muon.py ``uses_muon`` picks, as the step's plan lists them (tp's share each):
    # the rest of the rank's dense parameters (norms, embeddings, head, every 1-D bias, sink, gate and
    # Gated DeltaNet's A_log and dt_bias) stay on AdamW. Until 7 Dec the AdamW set was the norms and
    # embeddings alone: tiny-gpt-oss's biases, sinks and router bias and tiny-qwen3-next's 3-D conv
    # weight were on the wrong side (optimizer bytes 1.00145 and 0.99986 of the rehearsal).
    _, expert, _ = rank_params(cfg, lay, r)
    dense = sum(_tp_numel(mx, lay.tp) for mx in rank_matrices(cfg, lay, r) if not mx.expert)
    return (float(dense), expert, qk_clip_bytes(cfg, lay, r))


def optimizer_bytes(opt_adamw: float, split: tuple, lay: Layout, zero: int) -> float:
    """The rank's optimizer bytes: AdamW's figure less what Muon does not keep, plus QK-clip's buffers
    (``split`` from :func:`muon_split`; () leaves AdamW's figure)."""
    if not split:
        return opt_adamw
    d_dense = lay.dp * lay.cp
    d_exp = max(d_dense // max(lay.ep, 1), 1)
    muon_as_adamw = state_bytes(split[0], split[1], d_dense, d_exp, zero, lay.pp, lay.precision, lay.schedule)[2]
    return opt_adamw - (1 - MUON_STATE_RATIO) * muon_as_adamw + (split[2] if len(split) > 2 else 0)


# ------------------------------------------------------------------ the matrices Muon steps
#: (resolve/cost/optimizer_step.py times them; here, below the cost model, so that the memory plan
#: takes Muon's side of the optimizer from the same list)
@functools.lru_cache(maxsize=4096)
def _ns_flops(m: int, n: int, steps: int) -> float:
    k, big = min(m, n), max(m, n)
    return steps * (4.0 * k * k * big + 2.0 * k ** 3)


class Matrix(NamedTuple):
    """A matrix (or a stack of them) Muon steps on a pipeline rank, whole (before tp; an expert
    stack holds the rank's E/ep experts). ``tp``: how tensor parallel places it — "col"
    (ColwiseParallel: its rows split), "row" (RowwiseParallel: its columns split), "rep" (a Replicate
    DTensor: MLA's down-projections, MTP's projection, the delta rule's conv) or "" (a plain tensor:
    the MoE block, which tp leaves whole); ``expert``: held per ep rank."""

    stack: int
    rows: int
    cols: int
    tp: str
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.stack * self.rows * self.cols

    def flops(self, steps: int) -> float:
        return self.stack * _ns_flops(self.rows, self.cols, steps)

    @property
    def cost(self) -> int:  # paralayer/optim/owners.py ns_cost: the owners' balance
        return self.stack * self.rows * self.cols * min(self.rows, self.cols)


def mixer_matrices(cfg: Config, linear: bool) -> list:
    """The token mixer's Muon matrices, in the module's order: a Gated DeltaNet's
    (model/linear/gated_deltanet.py: its depthwise conv weight, C × 1 × K, a stack of 1 × K), MLA's or
    attention's (q with Qwen3-Next's gate rows under ``model.attn_gate``)."""
    m = cfg.model
    h = m.d_model
    if linear:
        li = m.linear
        hk, hv, dk, dv = li.k_heads, li.v_heads, li.head_k_dim, li.head_v_dim
        return [Matrix(1, 2 * hk * dk + 2 * hv * dv, h, "col"), Matrix(1, 2 * hv, h, "col"),
                Matrix(2 * hk * dk + hv * dv, 1, li.conv_kernel, "rep"), Matrix(1, h, hv * dv, "row")]
    if m.mla.kv_lora_rank > 0:
        a, nh = m.mla, m.n_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = ([Matrix(1, nh * qk, h, "col")] if a.q_lora_rank is None else
             [Matrix(1, a.q_lora_rank, h, "rep"), Matrix(1, nh * qk, a.q_lora_rank, "col")])
        return q + [Matrix(1, a.kv_lora_rank + a.qk_rope_head_dim, h, "rep"),
                    Matrix(1, nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, "col"),
                    Matrix(1, h, nh * a.v_head_dim, "row")]
    hd = m.head_dim or h // m.n_heads
    return [Matrix(1, (2 if m.attn_gate else 1) * m.n_heads * hd, h, "col"), Matrix(1, m.n_kv_heads * hd, h, "col"),
            Matrix(1, m.n_kv_heads * hd, h, "col"), Matrix(1, h, m.n_heads * hd, "row")]


def ffn_matrices(cfg: Config, moe: bool, ep: int, biases: bool = True) -> list:
    """The feed-forward's: the SwiGLU MLP's, or the MoE block's (model/moe.py: the expert stacks, E/ep
    of them, GPT-OSS's expert biases (2-D: E/ep × width, Muon's too), the router, the shared expert and
    its gate; ``biases=False``: without the biases, the time model's)."""
    m = cfg.model
    h = m.d_model
    if not moe:
        return [Matrix(1, m.ffn_hidden, h, "col"), Matrix(1, m.ffn_hidden, h, "col"), Matrix(1, h, m.ffn_hidden, "row")]
    e = m.moe
    fe, n_e = e.ffn_hidden or m.ffn_hidden, e.num_experts // max(ep, 1)
    out = [Matrix(n_e, fe, h, "", True), Matrix(n_e, fe, h, "", True), Matrix(n_e, h, fe, "", True),
           Matrix(1, e.num_experts, h, "")]
    if biases and e.expert_bias:
        out += [Matrix(1, n_e, fe, "", True), Matrix(1, n_e, fe, "", True), Matrix(1, n_e, h, "", True)]
    sh = e.shared_ffn_hidden
    if sh:
        out += [Matrix(1, sh, h, ""), Matrix(1, sh, h, ""), Matrix(1, h, sh, "")]
        if e.shared_gate:
            out.append(Matrix(1, 1, h, ""))
    return out


def block_matrices(cfg: Config, i: int, ep: int) -> list:
    """Layer ``i``'s Muon matrices (paralayer/optim/muon.py ``uses_muon``: every matrix of the block);
    an MTP block (i ≥ n_layers) adds its 2h → h projection."""
    out = mixer_matrices(cfg, parts.is_linear_layer(cfg, i)) + ffn_matrices(cfg, parts.is_moe_layer(cfg, i), ep)
    if i >= cfg.model.n_layers:
        out.append(Matrix(1, cfg.model.d_model, 2 * cfg.model.d_model, "rep"))
    return out


def rank_matrices(cfg: Config, lay, r: int, memo: dict | None = None) -> list:
    """Pipeline rank ``r``'s Muon matrices: its chunks' blocks, and the MTP blocks on the last chunk's.
    ``memo``: {(layer kind, ep): its block's} (plan_seconds' cache: a block's matrices are its kind's)."""
    out = []
    for c in rank_chunks(lay, r):
        layers = list(lay.stage_layers[c]) + (parts.mtp_layers(cfg) if c == lay.chunks - 1 else [])
        for i in layers:
            if memo is None:
                out += block_matrices(cfg, i, lay.ep)
                continue
            key = ("block", memo["kinds"][i], lay.ep)
            if key not in memo:
                memo[key] = block_matrices(cfg, i, lay.ep)
            out += memo[key]
    return out


def _tp_numel(mx: Matrix, tp: int) -> int:
    return mx.numel // tp if (tp > 1 and mx.tp in ("col", "row")) else mx.numel
