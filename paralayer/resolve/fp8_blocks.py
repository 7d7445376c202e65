"""What an FP8 block saves and sends under tp and cp beyond the base precision's rules
(train.precision=fp8; issue 44). Torch-free.

Why its own terms: an FP8 block's linears are Float8Linear (paralayer/model/float8.py), which
neither the bf16 activation fit nor the SP collectives describe:

- tp: the block takes its linears' DTensor styles, never the SP GEMMs (parallel/tensor/layout.py):
  the column GEMMs' input is gathered once and saved whole, no backward re-gather. Under
  tensorwise on a GPU plan the styles are torchao's float8 ones (``fp8`` here): the input is cast
  to FP8 before its all-gather (e4m3, 1 byte, saved by wq/wk/wv together, w1/w3 together), the
  output gradient before its backward all-gather (e5m2, 1 byte); wo's and w2's inputs are cast
  to FP8 by their row-parallel style and saved as such (wo's beside the core's own output, w2's
  in place of the SwiGLU product). The reduce-scatters move the output (base precision) and the
  input gradient (the norms' output dtype: fp32 under autocast). Otherwise (rowwise; a CPU plan)
  the styles are DTensor's plain ones (``plain``): the gathered input in the norms' dtype, which
  under autocast each linear casts again for itself (q, k, v: three bf16 copies; w1, w3: two).
- cp (tensorwise, tp 1): each Float8Linear casts its input to FP8 over the cp group's amax and
  saves that FP8 copy (one per linear: q, k, v, wo, w1, w3, w2's in place of the product); under
  autocast the ring takes RoPE's fp32 q and k and returns fp32, beside the FP8 copy of wo's input.
- cp (rowwise, any tp): each Float8Linear saves its input in the GEMM's dtype as autocast's linear
  would, but under autocast the ring's fp32 q, k and output (the latter beside wo's own bf16 copy)
  are not in the base rules (as for a bf16 block, which the bf16 plan leaves as it is).
- blockwise (any tp, cp 1): its GEMMs save their input as it comes, the norms' output (fp32
  under autocast) once for q, k, v and once for w1, w3, gathered whole under tp + SP (the plain
  styles), where the base counts autocast's bf16 casts (:func:`_blockwise_inputs`).
- cp (both): the scales that span tokens take their amax over the cp group, all-reduces in the
  activations' dtype (:func:`cp_amax`: rowwise's K + N per weight gradient, tensorwise's one number
  per input and output gradient).

Measured with ``--rehearse`` (a rank of the full world on fake tensors), where a torchao float8
tensor counts its FP8 data and scale (rehearse/memory.py, rehearse/comm.py): tiny at tp 2 with SP
and at cp 2 (tensorwise, rowwise; rowwise tp 2 · cp 2 too) on an H100 layout (docs/planner.md,
tests/test_fp8_tp_cp.py). Counted for GQA blocks (the attention part of an MoE block too); MLA
and Gated DeltaNet blocks under FP8 with tp or cp keep the base rules (not measured). Left out:
tensorwise's amax all-reduces over tp (8 bytes each) and the scales (4 bytes a tensor).
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.fp8 import fp8_layers
from paralayer.resolve.memory.states import ACT_BYTES, layer_recompute, precision_mode
from paralayer.resolve.model_parts import is_moe_layer
from paralayer.resolve.rules import Layout


def tp_styles(cfg: Config, lay: Layout) -> str | None:
    """How an FP8 block's linears are split over tp: ``"fp8"`` (torchao's float8 styles:
    tensorwise on a GPU plan without cp, runtime/build.py ``fp8_comm``), ``"plain"`` (DTensor's:
    rowwise, a CPU plan, or cp, whose scales span the cp ranks' tokens), None where no FP8 GQA
    block meets tp."""
    if cfg.train.precision != "fp8" or lay.tp == 1 or not _gqa_fp8(cfg):
        return None
    fp8 = cfg.train.fp8.recipe == "tensorwise" and lay.device == "cuda" and lay.cp == 1
    return "fp8" if fp8 else "plain"


def _gqa_fp8(cfg: Config) -> bool:
    return bool(fp8_layers(cfg)) and parts.attention_kind(cfg) == "gqa"


def _autocast(lay: Layout) -> bool:
    return precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) == "bf16-autocast"


def act_delta(cfg: Config, lay: Layout, moe: bool, mode: str, linear: bool = False) -> float:
    """What an FP8 block saves per token beyond the base rules (``activations.act_elems_per_token``),
    in units of ``ACT_BYTES[precision]``; 0 where none of the terms above apply. Applied to every
    block of the kind: with ``train.fp8.bf16_first/last_blocks`` under tp or cp the bf16 blocks
    count as FP8 ones (not separated here: the activation tables go by kind)."""
    if linear or mode == "full" or cfg.train.precision != "fp8" or not _gqa_fp8(cfg):
        return 0.0
    m = cfg.model
    h, f, t = m.d_model, m.ffn_hidden, lay.tp
    q, kv = m.n_heads * parts.head_dim(cfg), m.n_kv_heads * parts.head_dim(cfg)
    ab = ACT_BYTES[lay.precision]
    auto = _autocast(lay)
    norm_b = 4 if auto else ab  # the norms' output: fp32 under autocast, else the activations' dtype
    core = mode in ("core_attn", "selective")  # the core's output recomputed: wo's input is its only copy
    if cfg.train.fp8.recipe == "blockwise":
        return _blockwise_inputs(lay, moe, h, ab, norm_b, auto)
    styles = tp_styles(cfg, lay)
    ring = _ring(cfg, lay, q, kv, ab) if auto and not core else 0.0
    wo = -(ab - 1) * q / t if core else q / t  # wo's FP8 copy of its input (split by heads)
    shard = h / t * norm_b  # under SP the base counts a column GEMM's input as its sequence shard
    if styles == "plain" and lay.cp > 1 and cfg.train.fp8.recipe == "tensorwise":
        # tp and cp: each Float8Linear saves the FP8 copy of its input (the gathered, whole one:
        # q, k, v, w1, w3), where the base counts the shard (SP) or autocast's casts; wo's FP8
        # copy; w2's in place of the SwiGLU product; the ring's fp32 q, k and output
        sp = lay.sequence_parallel
        attn = 3 * h - (shard if sp else (3 if auto else 1) * h * ab) + wo
        ffn = 2 * h - (shard if sp else (2 if auto else 1) * h * ab) - (ab - 1) * f / t
        return (attn + (0.0 if moe else ffn) + ring) / ab
    if styles is not None and lay.sequence_parallel:
        if styles == "fp8":
            attn = h - shard + wo
            ffn = h - shard - (ab - 1) * f / t
        else:
            attn = (3 * h * 2 if auto else h * ab) - shard
            ffn = (2 * h * 2 if auto else h * ab) - shard
        return (attn + (0.0 if moe else ffn) + ring) / ab
    if styles == "fp8":
        # without SP: the replicated input cast to FP8 once a part, where the base counts autocast's
        # casts (three for q, k, v; two for w1, w3) or the one shared input
        attn = h - (3 if auto else 1) * h * ab + wo
        ffn = h - (2 if auto else 1) * h * ab - (ab - 1) * f / t
        return (attn + (0.0 if moe else ffn) + ring) / ab
    if lay.cp > 1 and lay.tp == 1 and cfg.train.fp8.recipe == "tensorwise":
        if moe:  # an MoE block's FP8 GEMMs under cp: not measured, the base rules
            return 0.0
        # five FP8 copies of the normed input where the base counts autocast's five casts or the
        # two shared inputs; wo's FP8 copy; the ring's fp32 q, k and output under autocast
        return (5 * h - (5 if auto else 2) * h * ab + wo + ring - (ab - 1) * f) / ab
    return ring / ab


def _blockwise_inputs(lay: Layout, moe: bool, h: int, ab: float, norm_b: float, auto: bool) -> float:
    """What a blockwise block saves beyond the base rules, in units of ``ab``: its GEMMs
    (model/float8.py ``_BlockwiseMatmul``) save their input as it comes, the norms' output (fp32
    under autocast), one tensor for wq, wk, wv and one for w1, w3 (gathered whole under tp + SP:
    the plain styles), where the base counts autocast's bf16 casts (three, two), the one shared
    input, or under SP its sequence shard. An MoE block's attention only (its experts' inputs: the
    base rules). Under cp: not measured, the base rules. Rehearsed / plan before this term (tiny,
    H100, ZeRO-1): tp 1 0.963, tp 2 + SP 0.938, tp 2 without SP 0.946 (docs/planner.md)."""
    if lay.cp > 1:
        return 0.0
    n = 1 if moe else 2  # the attention, and a dense FFN
    if lay.tp > 1 and lay.sequence_parallel:
        base = n * h / lay.tp * norm_b
    else:
        base = ((3 if moe else 5) if auto else n) * h * ab
    return (n * h * norm_b - base) / ab


def _ring(cfg: Config, lay: Layout, q: int, kv: int, ab: float) -> float:
    """Bytes per token that a block under cp and autocast saves beyond the base rules (with the
    core's output kept), split over tp by heads: the ring takes RoPE's fp32 q and k (``q + kv``
    wide, where the base counts the activations' dtype) and returns fp32. Rowwise: wo's
    Float8Linear casts that output to a copy of its own (the base counts one shared copy), 4·q.
    Tensorwise: the fp32 output is saved beside wo's FP8 copy, which :func:`act_delta` counts apart,
    (4 - ab)·q. A bf16 block saves the same
    as rowwise, which the bf16 plan leaves out (docs/planner.md)."""
    if lay.cp == 1 or cfg.train.fp8.recipe not in ("rowwise", "tensorwise"):
        return 0.0
    out = 4 * q if cfg.train.fp8.recipe == "rowwise" else (4 - ab) * q
    return ((q + kv) * (4 - ab) + out) / lay.tp


def tp_comm_delta(cfg: Config, lay: Layout, layers: list, is_moe,
                  tokens: float) -> tuple[float, float, float, int]:
    """(collective pairs, bytes in units of one s·b·h activation message, amax all-reduce bytes and
    their count) per microbatch that a rank's FP8 blocks (``layers``, global indices; ``is_moe(i)``)
    move beyond the base rule (cost.terms._tp_comm: per part, the attention or a dense FFN, 2
    pairs and half a pair for its backward re-gather under SP; 2 all-reduces without).

    Under SP a float8-styled part moves its input's all-gather and its output gradient's at 1
    byte, its output's reduce-scatter in the activations' dtype, its input gradient's in the
    norms' (fp32 under autocast); a plain-styled part gathers its input in the norms' dtype and
    its output gradient in the activations'; neither re-gathers. Without SP either styles' part
    all-reduces its output in the activations' dtype and its input gradient in the norms'.
    Rowwise scales a row that tp splits over the whole row: per part and microbatch an fp64 amax
    all-reduce of each token row of the row-parallel input (forward) and of each column-parallel
    output gradient (backward), and of the d_model rows of each weight (attention 4 + 4, FFN
    3 + 3; ``tokens`` the microbatch's; not counted again for full recompute's rerun).
    Tensorwise takes one fp64 amax (8 bytes) over tp for every cast of a tp-split tensor, and
    torchao casts each operand again in backward from its saved high-precision copy: each weight
    (forward, and for the input gradient), a row-parallel input (forward, and for the weight
    gradient) and a column-parallel output gradient (input and weight gradients): 4 a linear, 16
    a part with attention, 12 with a dense FFN, per microbatch; full recompute's rerun casts the
    weights and the row-parallel inputs once more (5, 4). Under FSDP's FP8 all-gather (ZeRO 2/3)
    the weights' scales are precomputed once a step and their casts reduce nothing. Counted with
    the plain styles the rehearsal runs (gloo); the float8 styles' input casts before their FP8
    all-gather are not."""
    styles = tp_styles(cfg, lay)
    sp = lay.sequence_parallel
    if styles is None or lay.tp_overlap:
        return 0.0, 0.0, 0.0, 0
    ab = ACT_BYTES[lay.precision]
    norm_b = 4 if _autocast(lay) else ab
    # one part under SP: two all-gathers and two reduce-scatters, half each; without SP the
    # output's all-reduce in the activations' dtype and the input gradient's in the norms', as the
    # base counts them since 7 Dec (cost/terms.py _tp_comm: every part's input gradient, FP8 or not)
    if not sp:
        part, base, regather = ab + norm_b, 1 + norm_b / ab, 0.0
    else:
        part, base, regather = ((2 + ab + norm_b) / 2 if styles == "fp8" else norm_b + ab), 2.5, 0.5
    rowwise = cfg.train.fp8.recipe == "rowwise"
    tensorwise = cfg.train.fp8.recipe == "tensorwise"
    fsdp_fp8 = lay.zero >= 2 and lay.dp * lay.cp > 1  # FSDP's FP8 all-gather (resolve/fp8.fp8_gathered_params)
    fp8 = set(fp8_layers(cfg))
    pairs = units = amax = 0.0
    count = 0
    for i in layers:
        if i not in fp8:
            continue
        n = 1 if is_moe(i) else 2  # parts in FP8 tp: the attention, and a dense FFN
        pairs -= n * regather  # no re-gather: 2 pairs a part, where the base counts 2.5
        units += n * part / ab - n * base
        if sp and layer_recompute(lay, i) == "full":
            # full recompute reruns the forward: the input's all-gather again (1 byte under the
            # float8 styles, the norms' dtype under the plain ones) and the output's reduce-scatter,
            # where the base counts one pair in the activations' dtype a part
            units += n * ((1 if styles == "fp8" else norm_b) + ab) / (2 * ab) - n
        if rowwise:
            reduced = 4 if n == 1 else 7  # the attention's reductions, and the FFN's 3
            amax += 8.0 * reduced * (tokens + cfg.model.d_model)
            count += 2 * reduced
        elif tensorwise:
            casts = 16 + (12 if n == 2 else 0)
            if layer_recompute(lay, i) == "full":
                casts += 5 + (4 if n == 2 else 0)
            if fsdp_fp8:  # the weights' scales precomputed once a step (model/float8.py refresh_scales)
                rerun = 4 + (3 if n == 2 else 0) if layer_recompute(lay, i) == "full" else 0
                casts -= 8 + (6 if n == 2 else 0) + rerun
            amax += 8.0 * casts
            count += casts
    return pairs, units, amax, count



def cp_amax(cfg: Config, lay: Layout, layers: list, full) -> tuple[float, int]:
    """(bytes, count) per microbatch of the amax all-reduces (MAX) over cp of a rank's FP8 blocks
    (``layers``, global indices; ``full(i)``: full recompute reruns layer i), each in the GEMM's
    input dtype (the activations'), model/float8.py ``Fp8Linear``:

    - rowwise: each linear's weight-gradient operands, scaled per column along the tokens, in
      backward: the input's K amaxes and the output gradient's N (``_TokenScaledMatmul``); under
      tp a column-parallel linear's N and a row-parallel one's K are the rank's share.
    - tensorwise: one number for each linear's input (forward, again in full recompute's rerun) and
      one for its output gradient (backward); under tp after DTensor's own over tp.

    Counted for a GQA attention and a dense SwiGLU FFN (7 linears); an MoE block's attention (4),
    its shared expert (3) and, at ep=1, each routed expert's 3 GEMMs (``ExpertMatmul``, whole on
    every tp rank; under ep an expert's GEMM runs once per micro-batch and reduces nothing)."""
    if cfg.train.precision != "fp8" or lay.cp == 1 or not _gqa_fp8(cfg):
        return 0.0, 0
    recipe = cfg.train.fp8.recipe
    if recipe not in ("rowwise", "tensorwise"):
        return 0.0, 0  # blockwise reduces nothing over cp
    m = cfg.model
    h, f, t = m.d_model, m.ffn_hidden, lay.tp
    q, kv = m.n_heads * parts.head_dim(cfg), m.n_kv_heads * parts.head_dim(cfg)
    ab = ACT_BYTES[lay.precision]
    # the K + N amaxes of wq, wk, wv, wo, w1, w3, w2 (the tp-split side divided by tp)
    rows = 7 * h + (2 * q + 2 * kv + 3 * f) / t
    moe = m.moe
    g, fe = moe.shared_ffn_hidden, moe.ffn_hidden or f
    experts = moe.num_experts if lay.ep == 1 else 0
    # an MoE block: the attention's 4, the shared expert's 3 (split as a dense FFN), the experts' 3 each
    moe_rows = 4 * h + (2 * q + 2 * kv) / t + (3 * h + 3 * g / t if g else 0) + experts * 3 * (h + fe)
    moe_gemms = 4 + (3 if g else 0) + 3 * experts
    # the experts' w1 and w3 take the routed rows as the norm gives them (fp32 under autocast):
    # their input amaxes in that dtype (rowwise: h each; tensorwise: one each, and in the rerun)
    wide = (4 if _autocast(lay) else ab) - ab
    nbytes, count = 0.0, 0
    for i in set(layers) & set(fp8_layers(cfg)):
        moe_i = is_moe_layer(cfg, i)
        gemms = moe_gemms if moe_i else 7
        if recipe == "rowwise":
            nbytes += ab * (moe_rows if moe_i else rows) + (wide * 2 * experts * h if moe_i else 0)
            count += 2 * gemms
        else:
            n = (3 if full(i) else 2) * gemms
            nbytes += ab * n + (wide * 2 * experts * (2 if full(i) else 1) if moe_i else 0)
            count += n
    return nbytes, count
