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

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.states import rank_layers, rank_params, state_bytes
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
    from paralayer.resolve.cost.optimizer_step import _tp_numel, rank_matrices

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
