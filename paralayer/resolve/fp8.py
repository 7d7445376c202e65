"""FP8 training's rules and the plan's ``fp8`` section (train.precision=fp8), before any rank starts.

Why here and not in the runtime: a GEMM FP8 cannot take (a local K or N that is not a multiple of
16 after tp; for blockwise under tp a split K or N that is not a multiple of 128), a GPU without
FP8 tensor cores, or a layout the FP8 path is not built for must fail in the resolver, exit 2
with one line, not minutes later inside a rank.

What runs in FP8 (paralayer/model/float8.py builds it): the blocks' linear GEMMs (attention
projections, MLP, MoE experts and shared expert), except the first ``train.fp8.bf16_first_blocks``
and last ``bf16_last_blocks`` blocks; the attention core, norms, router, embedding, head and MTP
depths stay in the base precision (bf16 on GPUs, fp32 on CPU, where the FP8 casts are emulated:
the same quantisation, the matmuls in fp32). Torch-free.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve.model_parts import is_moe_layer

#: GPU kinds whose tensor cores have no FP8 (before Hopper / Ada), by profile name.
PRE_FP8_GPUS = ("v100", "p100", "t4", "a100", "a800", "a10", "a30", "a40", "a6000")
#: names that say the GPU has FP8 tensor cores (Hopper, Ada, Blackwell).
FP8_GPUS = ("h100", "h200", "h800", "h20", "gh200", "l40", "l4", "4090", "b100", "b200", "gb200", "b300")
#: the local K and N an FP8 GEMM takes: torch._scaled_mm needs multiples of 16. Blockwise scales
#: 1x128 activation tiles and 128x128 weight blocks, but a K or N that 128 does not divide ends in
#: a partial tile / block with its own scale (DeepSeek's ceil-div scale grids; model/float8.py
#: qdq_tiles), so it needs only what the GEMM needs (it asked 128 before 7 Dec, which refused
#: DeepSeek-V3's own kv_a, N = 512 + 64). Under tp a split K or N must hold whole tiles on a
#: rank (:func:`blockwise_tp_splits`).
ALIGN = {"tensorwise": 16, "rowwise": 16, "blockwise": 16}
#: blockwise's tile / block edge (DeepSeek-V3 §3.3)
BLOCK = 128
#: the GEMMs tp splits, and along what: column-parallel N, row-parallel K (parallel/tensor/layout.py;
#: MLA's q_a and kv_a are replicated, the MoE experts and shared expert run whole on every tp rank)
TP_SPLIT = {"attention.wq": "N", "attention.wk": "N", "attention.wv": "N", "attention.q_b": "N",
            "attention.kv_b": "N", "attention.wo": "K", "feed_forward.w1": "N", "feed_forward.w3": "N",
            "feed_forward.w2": "K"}


#: elements per fp32 scale along a row of an activation cached in FP8 (train.fp8.cache_activations;
#: DeepSeek-V3's 1x128 tiles; model/float8.py Fp8Tiles)
CACHE_TILE = 128
#: bytes a weight's gathered copy holds under FSDP2 without FP8: its mixed-precision param dtype
_GATHER_BYTES = {"bf16": 2, "fp32": 4}


def cache_tile(row: int) -> int:
    """The tile along a cached row of ``row`` elements: 128 where it divides the row, else the row."""
    return CACHE_TILE if row % CACHE_TILE == 0 else row


def cached_bytes(row: int) -> float:
    """Bytes per element of an activation cached in FP8: the e4m3 value and its tile's fp32 scale."""
    return 1.0 + 4.0 / max(cache_tile(row), 1)


def fp8_layers(cfg: Config) -> list[int]:
    """Global indices of the blocks whose GEMMs run in FP8."""
    f, n = cfg.train.fp8, cfg.model.n_layers
    return list(range(min(f.bf16_first_blocks, n), max(n - f.bf16_last_blocks, 0)))


def local_gemms(cfg: Config, tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of each FP8 GEMM kind of a block on one rank after tp (experts: not split by
    tp, only by ep along the expert dimension, which leaves each expert's GEMMs whole)."""
    m = cfg.model
    out: list[tuple[str, int, int]] = []
    if m.mla.kv_lora_rank > 0:
        a = m.mla
        qk, heads = a.qk_nope_head_dim + a.qk_rope_head_dim, m.n_heads // tp
        if a.q_lora_rank is None:
            out.append(("attention.wq", m.d_model, heads * qk))
        else:
            out += [("attention.q_a", m.d_model, a.q_lora_rank), ("attention.q_b", a.q_lora_rank, heads * qk)]
        out += [("attention.kv_a", m.d_model, a.kv_lora_rank + a.qk_rope_head_dim),
                ("attention.kv_b", a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim)),
                ("attention.wo", heads * a.v_head_dim, m.d_model)]
    else:
        hd = m.head_dim or m.d_model // m.n_heads
        q, kv = m.n_heads * hd // tp, m.n_kv_heads * hd // tp
        out += [("attention.wq", m.d_model, q), ("attention.wk", m.d_model, kv), ("attention.wv", m.d_model, kv),
                ("attention.wo", q, m.d_model)]
    moe = m.moe
    dense_too = moe.num_experts == 0 or moe.every > 1 or moe.first_k_dense > 0
    if dense_too:
        f = m.ffn_hidden // tp
        out += [("feed_forward.w1", m.d_model, f), ("feed_forward.w3", m.d_model, f),
                ("feed_forward.w2", f, m.d_model)]
    if moe.num_experts > 0:
        f = moe.ffn_hidden or m.ffn_hidden
        # the SwiGLU's three GEMMs, w3 (up) beside w1 (gate) (it was left out before 7 Dec: an MoE
        # block's FP8 time and FP8 all-gather counted two of the three)
        out += [("experts.w1", m.d_model, f), ("experts.w3", m.d_model, f), ("experts.w2", f, m.d_model)]
        if moe.shared_ffn_hidden:
            g = moe.shared_ffn_hidden
            out += [("shared.w1", m.d_model, g), ("shared.w3", m.d_model, g), ("shared.w2", g, m.d_model)]
    return out


def blockwise_tp_splits(cfg: Config, tp: int) -> list[tuple[str, str, int]]:
    """(GEMM, dimension, local size) of each tp-split K or N of a block that is not a multiple of
    :data:`BLOCK` on a rank: there a tile or block would straddle two ranks (the runtime tiles each
    rank's shard, model/float8.py tp_blockwise), so one rank's scales would not be one process's."""
    out = []
    for name, k, n in local_gemms(cfg, tp) if tp > 1 else []:
        d = TP_SPLIT.get(name)
        size = n if d == "N" else k
        if d and size % BLOCK:
            out.append((name, d, size))
    return out


def gpu_has_fp8(name: str) -> bool | None:
    """True/False when the profile's name says whether the GPU has FP8 tensor cores; None when unknown."""
    low = (name or "").lower()
    if any(k in low for k in FP8_GPUS):
        return True
    if any(k in low for k in PRE_FP8_GPUS):
        return False
    return None


def check_fp8(cfg: Config, lay, Issue: type) -> None:  # noqa: N803 - the rules' Issue class, passed in
    """The FP8 rules; each problem is an ``Issue`` on ``lay`` naming train.precision (or the field).
    rules.py passes its Issue class in: this module is below rules.py in the imports. The degrees
    are the layout's (``lay``), so the planner asks the same rules of each layout it weighs."""
    if cfg.train.precision != "fp8":
        return
    recipe, p = cfg.train.fp8.recipe, lay
    err = lay.errors.append
    if lay.device == "cuda":
        has = gpu_has_fp8(cfg.cluster.name)
        if has is False:
            err(Issue("train.precision", f"train.precision=fp8 needs FP8 tensor cores (Hopper or Ada and later: "
                      f"H100, H200, H800, L40, B200) but cluster {cfg.cluster.name} has none; valid: fp32, bf16"))
        elif has is None:
            lay.warnings.append(Issue("train.precision", f"cluster {cfg.cluster.name}: its GPU kind is not known to "
                                      "have FP8 tensor cores (Hopper/Ada or later); torchao fails at the first GEMM "
                                      "otherwise"))
    else:
        lay.notes.append(f"train.precision=fp8 ({recipe}) on CPU runs emulated: the same FP8 casts, matmuls in fp32")
    # under ep the experts' GEMMs run once per micro-batch (model/moe.py), so that their scales that
    # span tokens cover one micro-batch's, as one process's do; under tp every tp rank runs the MoE
    # block on the whole (gathered) micro-batch, so a sender's rows are one; ep·tp·cp and tensorwise
    # tp·cp equal one process in fp64 to 8e-16 over 4 steps (tests/test_fp8.py, 8 Dec)
    if p.ep > 1 and p.cp > 1 and (p.ep % p.cp or recipe == "blockwise"):
        # an ep group of whole micro-batches (ep a multiple of cp: parallel/mesh.py puts a micro-batch's
        # cp ranks side by side) runs an expert's FP8 GEMM once over a micro-batch's rows (model/moe.py
        # ep_cp); blockwise's 128-row tiles would take them in cp-rank order, not one process's
        err(Issue("train.precision", f"train.precision=fp8 ({recipe}) is not built with parallel.ep={p.ep} and "
                  f"parallel.cp={p.cp}: an expert's scales that span tokens would cover part of a micro-batch, "
                  "not one process's; valid: parallel.ep a multiple of parallel.cp, with train.fp8.recipe "
                  "tensorwise or rowwise"))
    if p.cp > 1 and p.ep == 1 and recipe == "blockwise" and any(is_moe_layer(cfg, i) for i in fp8_layers(cfg)):
        # tensorwise and rowwise take an expert's amax over the cp group (model/float8.py ExpertMatmul,
        # since 7 Dec); blockwise's 128-row weight-gradient tiles run over one process's routed rows
        # of the whole micro-batch, which a cp rank's rows of an expert interleave with its peers'
        # (measured, one MoE block at cp2: expert weight grads 3.8e-2 off one process; fp32 2.5e-7)
        err(Issue("train.fp8.recipe", f"train.fp8.recipe=blockwise is not built for the MoE experts with parallel.cp="
                  f"{p.cp}: an expert's 128-row weight-gradient tiles would hold one cp rank's rows, not one "
                  "process's; valid: tensorwise, rowwise, or parallel.cp=1"))
    if lay.tp_overlap:
        err(Issue("train.precision", "train.precision=fp8 is not built with parallel.tp_overlap=true (the fused "
                  "ring GEMMs have no FP8 cast); valid: parallel.tp_overlap=false"))
    if recipe == "blockwise":
        _check_blockwise(cfg, p, err, Issue)
    if not fp8_layers(cfg):
        lay.warnings.append(Issue("train.fp8.bf16_first_blocks", "bf16_first_blocks + bf16_last_blocks cover every "
                                  "block: no GEMM runs in FP8"))
        return
    align = ALIGN[recipe]
    bad = [(n, k, nn) for n, k, nn in local_gemms(cfg, lay.tp) if k % align or nn % align]
    if bad:
        n, k, nn = bad[0]
        where = f" after parallel.tp={p.tp}" if p.tp > 1 else ""
        err(Issue("train.precision", f"train.precision=fp8 ({recipe}) needs each GEMM's K and N multiples of {align}"
                  f"{where}, but {n} is K={k}, N={nn} on a rank ({len(bad)} GEMM kinds fail); valid: "
                  f"train.precision=bf16, or widths (and tp) giving multiples of {align}"))


def _check_blockwise(cfg: Config, p, err, Issue: type) -> None:  # noqa: N803 - the rules' Issue class
    """check_fp8's blockwise rules: tp splits of whole 128 tiles, and the tokens a wgrad tile groups."""
    if p.tp > 1 and cfg.model.layer_types and "linear" in cfg.model.layer_types:
        err(Issue("train.fp8.recipe", f"train.fp8.recipe=blockwise is not built with parallel.tp={p.tp} for "
                  "Gated DeltaNet layers (their split projections are not checked for whole 128 tiles); "
                  "valid with tp > 1: tensorwise, rowwise"))
    elif p.tp > 1 and (split := blockwise_tp_splits(cfg, p.tp)):
        name, d, size = split[0]
        ok = [t for t in (1, 2, 4, 8, 16, 32, 64) if cfg.model.n_heads % t == 0 and not blockwise_tp_splits(cfg, t)]
        err(Issue("parallel.tp", f"train.fp8.recipe=blockwise with parallel.tp={p.tp} needs each tp-split GEMM "
                  f"dimension a multiple of {BLOCK} on a rank (a tile must not straddle two ranks), but {name} "
                  f"has {d}={size} on a rank ({len(split)} split dimensions fail); valid: parallel.tp in "
                  f"{', '.join(map(str, ok))}, or train.fp8.recipe=tensorwise, rowwise"))
    chunk = cfg.model.seq_len // (2 * p.cp) if p.cp > 1 else cfg.model.seq_len
    if chunk % BLOCK:
        err(Issue("train.fp8.recipe", f"train.fp8.recipe=blockwise groups 128 tokens for the weight gradient: "
                  f"the tokens per sequence chunk (model.seq_len={cfg.model.seq_len}"
                  + (f"/(2·parallel.cp={p.cp})" if p.cp > 1 else "") + f" = {chunk}) must be a multiple of "
                  "128; valid recipes here: tensorwise, rowwise"))


def plan_section(cfg: Config, lay) -> dict | None:
    """The plan's ``fp8`` section: the recipe, which blocks and GEMMs run in FP8, what stays in the base
    precision, whether the casts are emulated (CPU)."""
    if cfg.train.precision != "fp8":
        return None
    layers = fp8_layers(cfg)
    return {"recipe": cfg.train.fp8.recipe, "emulated": lay.device != "cuda", "base_precision": lay.precision,
            "fp8_layers": layers, "bf16_layers": [i for i in range(cfg.model.n_layers) if i not in layers],
            "fp8_gemms": [{"name": n, "k": k, "n": nn} for n, k, nn in local_gemms(cfg, lay.tp)],
            "base_precision_parts": ["attention core", "norms", "router", "embedding", "head", "mtp"]}


def layer_gemm_shapes(cfg: Config, tp: int, tokens: float,
                      moe_layer: bool) -> list[tuple[str, float, float, float, int]]:
    """(name, M, K, N, count) of one block's FP8 GEMMs on a rank: attention and the dense MLP at M =
    ``tokens``; a MoE block's experts at M = tokens · top_k / experts each (the mean routing)."""
    m = cfg.model
    out = []
    for name, k, n in local_gemms(cfg, tp):
        if name.startswith("feed_forward") and moe_layer:
            continue
        if name.startswith(("experts", "shared")) and not moe_layer:
            continue
        if name.startswith("experts"):
            e = m.moe.num_experts
            out.append((name, tokens * m.moe.top_k / e, k, n, e))
        else:
            out.append((name, tokens, k, n, 1))
    return out


def fp8_gathered_params(cfg: Config, lay, layers, zero: int | None = None) -> float:
    """Parameters of ``layers`` whose FSDP all-gather moves FP8 (1 byte) instead of the base
    precision: the FP8 blocks' linear weights under tensorwise with ZeRO 2/3 (the runtime's
    ``enable_fsdp_float8_all_gather``, model/float8.py, on GPUs and on CPU alike: tiny at tp 2, dp 2,
    ZeRO-3 gathers a block's 92,160 linear weights in 92,160 bytes beside its norms' 1,024, 7 Dec;
    until then the plan took CPU ranks to gather in fp32 and read dp 0.542 of the rehearsal). 0 otherwise.
    ``zero``: the stage (default the layout's)."""
    zero = lay.zero if zero is None else zero
    if cfg.train.precision != "fp8" or cfg.train.fp8.recipe != "tensorwise" or zero < 2:
        return 0.0
    fp8 = set(fp8_layers(cfg))
    # the routed experts are 3-D parameters behind model/moe.py's expert_mm, not Float8Linear
    # weights: FSDP gathers them in the base precision (the rehearsal's all-gathers, 7 Dec)
    per = {moe: sum(k * n * count for name, _, k, n, count in layer_gemm_shapes(cfg, lay.tp, 1.0, moe)
                    if not name.startswith("experts"))
           for moe in (False, True)}
    return float(sum(per[is_moe_layer(cfg, i)] for i in layers if i in fp8))


def fp8_copy_saving(cfg: Config, lay, layers, zero: int | None = None) -> float:
    """Bytes FSDP's FP8 all-gather saves on the gathered weights a rank HOLDS: under ZeRO-2 the
    gathered copies stay from forward to backward (memory.states.state_bytes counts them at 2 bytes),
    the FP8 blocks' linear weights at 1 byte there; ZeRO-3 holds one block at a time (not counted)."""
    zero = lay.zero if zero is None else zero
    if zero != 2 or lay.dp * lay.cp <= 1:
        return 0.0
    # each such weight held at 1 byte where the gathered copy would hold the base precision's
    # (bf16 2, fp32 4: tiny at dp 2, ZeRO-2 on CPU holds 3 bytes less a weight, 7 Dec)
    return fp8_gathered_params(cfg, lay, layers, zero) * (_GATHER_BYTES[lay.precision] - 1)


def fp8_gather_bytes(gathered: float, units: int, gathers: int, reduced: float) -> dict:
    """The FSDP dp entry's ``message_bytes`` and ``bytes_per_step`` once ``gathered`` bytes (one
    gather of the rank's weights, its FP8 ones at 1 byte) move ``gathers`` times per step beside
    the grads' ``reduced`` bytes (cost.terms._dp_comm)."""
    return {"message_bytes": int(gathered / units), "bytes_per_step": int(gathers * gathered + reduced)}
