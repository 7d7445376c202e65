"""The pairwise combination suite's generator: the feature space the planner searches, the pairs
that cannot run together, and a greedy pairwise covering array over the rest.

Why a covering array: the features below have 6·4·5·2·4·2·2·5·2·2·2 ≈ 300k combinations, far
too many to train; but most wrong-gradient bugs need two features to meet (V schedule × ZeRO-3,
issue #25). A covering array puts every value of every feature next to every value of every other
feature in at least one layout, in ~30 layouts.

The values come from the schema and the planner, not a hand list (``feature_values``): a new
schedule, recompute mode or router joins the array by itself, and tests/test_combinations.py fails
when the planner's output or the schema's ``parallel`` section grows a knob this file does not map.

A pair of values that cannot run together is DISALLOWED (:func:`disallowed`): the array does not
need to cover it, and the test asserts that the resolver refuses a layout holding it, naming the
field. A pair counts as covered only in a row where both values take effect (:data:`ENABLED_BY`):
``recompute_every`` acts only under ``recompute=full``, ``pp_layout`` only with a pipeline, ``ep``
only with experts; so ``recompute_every=2`` trains under every schedule (issue #37).

What the suite covers: every effective pair of the features below, on at most MAX_WORLD = 4 gloo
ranks (degrees of 2), 2 steps each, against one rank. Torch-free.

Why ``train.adam_eps=1e-5`` in BASE, not AdamW's 1e-8: step 2 compares the weights after one AdamW
step, whose update is lr·g/(|g| + eps) per element. Where a gradient element is zero to within fp32
rounding (|g| ~ 1e-7 of the tensor's largest, scaled by the clip 1/7.4), two summation orders (cp's
chunks, microbatches) give |g| ~ eps, and d(update)/dg ~ lr/eps turns a 1e-7 rounding difference
into an O(lr) weight difference: the row dualpipev × cp2 × ep2 × tied × softmax MoE × micro-batch 1
(REGRESSION_ROWS) was 3.3e-5 (loss) / 2.5e-4 (grad norm) off one rank at step 2 with eps 1e-8, from
TWO elements (layers.0.attention.wo[17,27]: -5.96e-8 on one rank, -1.86e-7 on four; w1[3,13,24]);
its per-tensor step-1 gradients matched to 2e-6 and no token's top-2 experts differed. Zeroing those
two elements in both runs gives 1.1e-7 / 1.4e-7. One rank against itself at micro-batch 4 (the same
sum in another order) is 1.6e-5 / 1.2e-4 off, so no tolerance could hold. At eps 1e-5 the update
moves by at most lr·Δg/eps there (1.7e-8 / 1e-5: ~2e-3 of lr, not 0.27 of it) while |g| ≫ eps
elsewhere keeps it Adam's: the row
matches to 1.1e-7 / 1.3e-7. Over all 48 rows the worst is 7.9e-7 / 7.3e-7 at 1e-5 (at 1e-8: this
row, then a dense gpipe row at 5.4e-6 grad norm); a planted skip of the tied-gradient sum still
fails the regression row by 3.9e-4 / 1.8e-2.
"""
from __future__ import annotations

import itertools
from typing import Optional

#: the tiny model every layout trains (seq 16 splits into 2·cp = 4 zigzag chunks and over cp·tp = 4
#: sequence-parallel ranks; tp 2 divides heads and FFN); 2 layers, 4 or 8 where the row's chunks
#: need them (:func:`n_layers`)
BASE = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=48",
        "model.vocab_size=64", "model.seq_len=16", "model.init_std=0.2",
        "model.moe.top_k=2", "model.moe.aux_loss_coef=0",
        "train.steps=2", "train.lr=3e-3", "train.warmup_steps=1", "train.adam_eps=1e-5", "train.precision=fp32", "train.threads=1",
        "data.format=tokens", "data.shuffle=false", "logging.wandb.mode=disabled", "logging.progress=false",
        "checkpoint.every=0", "cluster.device=cpu", "cluster.peak_tflops=1.0"]
EXPERTS = 4
CAPACITY = 1.0  # with top-2 of 4 experts some tokens drop: the dropping path runs
#: microbatches per data rank: 2 (gradient accumulation runs; interleaved needs a multiple of pp,
#: zbv at least pp), 4 under dualpipev (it needs 2·pp)
MICROBATCHES = {"dualpipev": 4}
#: the most ranks a row may take: pairwise coverage never needs three degrees > 1 at once, and on a
#: 2-core machine an 8-rank world costs twice a 4-rank one
MAX_WORLD = 4
#: ``pp_layout=uneven``: layers per chunk for 2 chunks (gpipe/1f1b) and for 4 (interleaved, V)
UNEVEN = {2: [1, 3], 4: [1, 3, 3, 1]}
TP, PP, CP, EP = 2, 2, 2, 2  # the degree a feature's "on" value uses (MAX_WORLD ranks at most)


#: rows kept beside the covering array: layouts that once failed (the module docstring says why this
#: one did: AdamW's eps, not the split). Features not named take the first value.
REGRESSION_ROWS = [dict(pipe="dualpipev", recompute="core_attn", moe="softmax", zero=1, cp=2, ep=2, tied=True,
                        micro_batch=1)]


def suite_rows() -> list[dict]:
    """The covering array (compacted beside the regression rows: :func:`compact`) and the regression
    rows (every feature set) the suite trains."""
    first = default_row()
    regression = [dict(first, **r) for r in REGRESSION_ROWS]
    return compact(covering_array(), regression) + regression


def feature_values() -> dict[str, tuple]:
    """Each feature and its values, from the schema and the planner's own tuples."""
    from paralayer.config.schema import RECOMPUTE, ROUTERS
    from paralayer.resolve.planner import SCHEDULES_PP

    moe = ("dense",) + tuple(f"{r}{cap}" for r in ROUTERS for cap in ("", "_cap")) + ("group",)
    return {
        "pipe": ("none",) + tuple(SCHEDULES_PP),   # none: pp = 1; else pp 2 (vpp 2 where it applies)
        # norm_up is refused under tp and cp, two of the array's axes (tests/test_norm_up.py)
        "recompute": tuple(r for r in RECOMPUTE if r != "norm_up"),
        "moe": moe,                                # router × capacity (dropless or capacity_factor); group: GROUP
        "tp": ("1", "sp", "nosp", "overlap"),      # tp 2 with sequence parallel / without / + tp_overlap
        "zero": (0, 1, 2, 3),
        "recompute_every": (1, 2),
        "cp": (1, CP),
        "ep": (1, EP),
        "tied": (False, True),
        "pp_layout": ("even", "uneven"),
        "micro_batch": (1, 2),
        "family": tuple(FAMILY),                  # the model's attention parts (issues #33, #34)
        "mtp": (0, 1),                            # multi-token prediction depth (issue #34)
    }


#: DeepSeek-V3's routing (issue #34): the sigmoid router by groups (2 groups of 2 experts, one
#: chosen per token, so a token's top-2 lie in one group), routed scaling, the first layer dense;
#: dropless. (The sequence-wise loss is not in the array: its value depends on which tokens share a
#: sequence, the same under every layout, and tests/test_routing.py checks it.)
GROUP = ["model.moe.router=sigmoid", "model.moe.n_group=2", "model.moe.topk_group=1",
         "model.moe.routed_scaling_factor=2.5", "model.moe.first_k_dense=1", "model.moe.capacity_factor=null"]

#: the model families' parts a layout must keep exact (issue #33), as overrides of BASE's model:
#: Qwen3's head_dim (12, not 32 / 4), per-head q/k norms and Llama 3.1's RoPE with positions past its
#: original 8; a sliding window of 6 (across cp's 4-token zigzag chunks) on the even layers, full on the odd ones
FAMILY = {"plain": [],
          "qwen3": ["model.head_dim=12", "model.qk_norm=true", "model.rope.type=llama3", "model.rope.factor=8",
                    "model.rope.original_max_position=8"],
          "window": ["model.sliding_window=6", "model.full_attention_every=2"],
          # DeepSeek-V3's latent attention (issue #34): a q down-projection, K of width nope 8 + rope 4 with
          # the rope key shared by the heads, V of width 6 (not the qk width), YaRN 4 with positions past 8
          "mla": ["model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=10", "model.mla.qk_nope_head_dim=8",
                  "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6", "model.n_kv_heads=4",
                  "model.rope.type=yarn", "model.rope.factor=4", "model.rope.original_max_position=8"]}
#: multi-token prediction (DeepSeek-V3 §2.2) on the last stage, by depth
MTP = {0: [], 1: ["model.mtp.depth=1", "model.mtp.loss_weight=0.3"]}
#: every key of the schema's model section: the feature that varies it, or None (fixed by BASE: the
#: shape, the init, and the parts whose value no split changes)
MODEL_FIELDS = {
    **{k: None for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "seq_len",
                         "rope_theta", "norm_eps", "init", "init_std")},
    "tie_embeddings": "tied", "head_dim": "family", "qk_norm": "family", "sliding_window": "family",
    "layer_types": "family", "full_attention_every": "family",
    **{f"rope.{k}": "family" for k in ("type", "factor", "original_max_position")},
    **{f"rope.{k}": None for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                                   "mscale_all_dim", "attention_factor")},
    **{f"moe.{k}": "moe" for k in ("num_experts", "router", "capacity_factor", "bias_update_rate",
                                   "first_k_dense", "n_group", "topk_group", "routed_scaling_factor")},
    **{f"moe.{k}": None for k in ("top_k", "ffn_hidden", "aux_loss_coef", "every", "shared_ffn_hidden",
                                  "norm_topk_prob", "seq_aux_loss_coef")},
    **{f"mla.{k}": "family" for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                      "v_head_dim")},
    **{f"mtp.{k}": "mtp" for k in ("depth", "loss_weight")},
    # Gemma 3's parts: fixed here (the base model's values); tests/test_families.py proves them against
    # Gemma3ForCausalLM under tp2, pp2, cp2 and dp2·ZeRO-3 -- not yet a family of this matrix
    **{k: None for k in ("embed_scale", "norm_offset", "post_norms", "mlp_act", "query_pre_attn_scalar",
                         "rope_local_theta")},
    # GPT-OSS's parts: fixed here; tests/test_families.py proves them against GptOssForCausalLM under tp2,
    # pp2, cp2, dp2·ZeRO-3 and ep2
    **{k: None for k in ("attn_bias", "attn_sinks", "rope.truncate", "moe.router_bias", "moe.expert_bias",
                         "moe.swiglu_limit", "moe.swiglu_alpha")},
    # Qwen3-Next's parts: fixed here; tests/test_qwen3_next.py proves them against Qwen3NextForCausalLM
    # under tp2 (+SP), pp2, dp2·ZeRO-3, ep2, cp2 and cp2 with tp2, dp2 or pp2
    **{k: None for k in ("attn_gate", "rotary_fraction", "moe.shared_gate", "linear.chunk", "linear.conv_kernel",
                         "linear.head_k_dim", "linear.head_v_dim", "linear.k_heads", "linear.v_heads")},
    # the HF weight layout of those layers (fused Qwen3-Next / split Qwen3.5): the same model, other names;
    # tests/test_qwen3_5.py proves it against Qwen3_5ForCausalLM under the same axes
    "linear.proj": None,
}


def disallowed(f: str, a, g: str, b) -> Optional[str]:
    """The field the resolver must name when value ``a`` of feature ``f`` meets value ``b`` of
    ``g`` (they cannot run together), or None when the pair is allowed."""
    for (f1, v1), (f2, v2) in (((f, a), (g, b)), ((g, b), (f, a))):
        if f1 == "ep" and v1 > 1 and f2 == "moe" and v2 == "dense":
            return "parallel.ep"  # expert parallel needs experts
        if f1 == "pp_layout" and v1 == "uneven" and f2 == "pipe" and v2 == "none":
            return "parallel.pp_layout"  # an uneven split needs pipeline chunks
        if f1 == "moe" and str(v1).endswith("_cap") and f2 == "cp" and v2 > 1:
            return "model.moe.capacity_factor"  # capacity counts a rank's own tokens: 1/cp of each sequence
        if f1 == "family" and v1 == "mla" and f2 == "tp" and v2 == "overlap":
            return "parallel.tp_overlap"  # the overlapped tp matmuls are built for the plain q/k/v projections
        if f1 == "mtp" and v1 > 0 and ((f2 == "cp" and v2 > 1) or (f2 == "zero" and v2 == 3)):
            return "model.mtp.depth"  # MTP reads the token k ahead (another cp rank); ZeRO-3 reshards the head
    return None


def refused_row(row: dict) -> Optional[str]:
    """The field the resolver names for a row refused by three of its values together (no pair of
    them is refused alone), or None. MTP with tied embeddings under pp: the shared table would have
    three copies (first stage, last stage, MTP)."""
    if row.get("mtp", 0) > 0 and row.get("tied") and row.get("pipe", "none") != "none":
        return "model.mtp.depth"
    return None


#: refused single values: (feature overrides, the field the resolver names). tp_overlap needs
#: sequence parallel, so the array's ``tp`` feature folds the two knobs into one (nosp + overlap
#: is the refused combination of them).
REFUSED_SETTINGS = [
    (["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.tp_overlap=true"], "parallel.tp_overlap"),
]


#: feature -> (the feature that switches it on, the test on that feature's value): where the test
#: fails, the first feature's value has no effect in the row, and its pairs do not count
ENABLED_BY = {
    "recompute_every": ("recompute", lambda v: v == "full"),  # full recompute on layers i % k == 0
    "pp_layout": ("pipe", lambda v: v != "none"),             # layers per pipeline chunk
    "ep": ("moe", lambda v: v != "dense"),                    # experts over ranks
}


def recomputed_regions(row: dict) -> set:
    """The regions the row's ``parallel.recompute`` reruns in its model (runtime/build.py
    apply_recompute), measured per row by tests/test_combinations.py: swiglu the SwiGLU product
    (a dense block's, and an MoE block's experts' and shared expert's); core_attn the attention
    core; selective both, but not in an MoE block's experts (``group`` has a dense first layer);
    full the block. A mode that reruns nothing in a row is inert there and its pairs do not count
    (issue 46: swiglu did nothing in MoE blocks, and 17 of its 36 pairs were counted unrun)."""
    dense = row.get("moe", "dense") in ("dense", "group")
    return {"none": set(), "swiglu": {"swiglu"}, "core_attn": {"core"},
            "selective": {"core"} | ({"swiglu"} if dense else set()), "full": {"block"}}[row.get("recompute", "none")]


def inert(row: dict) -> set:
    """The features of ``row`` whose value has no effect there (their switch is set and off, or
    its recompute mode reruns nothing: :func:`recomputed_regions`)."""
    out = {f for f, (g, on) in ENABLED_BY.items() if f in row and g in row and not on(row[g])}
    if row.get("recompute", "none") != "none" and not recomputed_regions(row):
        out.add("recompute")
    return out


def _row_ok(row: dict, first: dict) -> bool:
    """No disallowed pair, and at most MAX_WORLD ranks with the features not yet set at their
    ``first`` (cheapest) value."""
    items = list(row.items())
    if not all(disallowed(f, a, g, b) is None for (f, a), (g, b) in itertools.combinations(items, 2)):
        return False
    if refused_row(row) is not None:
        return False
    return world_size(dict(first, **row)) <= MAX_WORLD


def allowed_pairs(features: dict) -> set:
    """Every pair ((f, a), (g, b)) with f before g in ``features`` that may run together and can
    take effect together (a pair of a value with its switch off, e.g. recompute_every=2 with
    recompute=none, is never required)."""
    names = list(features)
    out = set()
    for i, j in itertools.combinations(range(len(names)), 2):
        f, g = names[i], names[j]
        for a in features[f]:
            for b in features[g]:
                if disallowed(f, a, g, b) is None and not inert({f: a, g: b}):
                    out.add(((f, a), (g, b)))
    return out


def all_pairs(row: dict, features: dict) -> set:
    """Every pair of values in ``row``, effective or not."""
    names = [n for n in features if n in row]
    return {((f, row[f]), (g, row[g])) for f, g in itertools.combinations(names, 2)}


def row_pairs(row: dict, features: dict) -> set:
    """The pairs ``row`` covers: those whose two values both take effect in it."""
    dead = inert(row)
    return {p for p in all_pairs(row, features) if p[0][0] not in dead and p[1][0] not in dead}


def covering_array(features: Optional[dict] = None, tries: int = 12) -> list[dict]:
    """A pairwise covering array over ``features`` (greedy, AETG-style, deterministic): each row
    starts from one of the first ``tries`` uncovered pairs, fills the other features one at a time
    with the value that covers the most uncovered pairs (ties: the first value, the cheapest), and
    the row that covers the most pairs per rank is kept. Every row holds only allowed pairs, and
    the seed pair's switches are set on (so each row covers its seed)."""
    features = features or feature_values()
    names = list(features)
    first = {n: v[0] for n, v in features.items()}
    uncovered = allowed_pairs(features)
    rows: list[dict] = []
    while uncovered:
        best, best_gain = None, -1
        for seed in sorted(uncovered, key=repr)[:tries]:
            (f, a), (g, b) = seed
            row = {f: a, g: b}
            for n in names:
                if n in row:
                    continue
                scored = []
                for v in features[n]:
                    cand = dict(row, **{n: v})
                    if _row_ok(cand, first) and not inert(cand) & {f, g}:
                        scored.append((len(row_pairs(cand, features) & uncovered), -features[n].index(v), v))
                row[n] = max(scored)[2]
            gain = len(row_pairs(row, features) & uncovered) / world_size(row)
            if gain > best_gain:
                best, best_gain = row, gain
        if best_gain <= 0:
            raise ValueError(f"no row within MAX_WORLD covers {sorted(uncovered, key=repr)[:3]}")
        rows.append({n: best[n] for n in names})
        uncovered -= row_pairs(best, features)
    return rows


def row_cost(row: dict) -> int:
    """A row's relative training cost: ranks × microbatches × layers (what a step's ops scale with)."""
    return world_size(row) * MICROBATCHES.get(row["pipe"], 2) * n_layers(row)


def compact(rows: list[dict], fixed: list[dict] = (), features: Optional[dict] = None) -> list[dict]:
    """``rows`` with every row dropped whose pairs the rest (and ``fixed``) cover, once the few pairs
    only it covers are moved into other rows (each by setting its two values there, where the row
    stays allowed, within MAX_WORLD, and loses no pair nothing else covers). The greedy array's last
    rows each cover one or two pairs; every row costs a world's training (~4 CPU-s at 4 ranks).
    Deterministic: the last row first; a moved pair goes to the row it makes cheapest."""
    from collections import Counter

    features = features or feature_values()
    first = {n: v[0] for n, v in features.items()}
    want = allowed_pairs(features)
    rows = [dict(r) for r in rows]
    held = Counter({p: len(rows) + 1 for r in fixed for p in row_pairs(r, features)})  # never lost
    for r in rows:
        held.update(row_pairs(r, features))
    i = len(rows) - 1
    while i >= 0:
        others = rows[:i] + rows[i + 1:]
        count = held - Counter(row_pairs(rows[i], features))
        for (f, a), (g, b) in sorted(want - set(count), key=repr):
            best = None
            for j, r in enumerate(others):
                cand = dict(r, **{f: a, g: b})
                if cand == r or not _row_ok(cand, first):
                    continue
                gone, new = row_pairs(r, features), row_pairs(cand, features)
                if ((f, a), (g, b)) in new and all(count[p] > 1 for p in gone - new):
                    key = (row_cost(cand) - row_cost(r), j)
                    if best is None or key < best[0]:
                        best = (key, j, cand, gone, new)
            if best is None:
                break
            _, j, cand, gone, new = best
            others[j] = cand
            count = count - Counter(gone) + Counter(new)
        if want <= set(count):
            rows, held = others, count
        i -= 1
    return rows


# ------------------------------------------------------------------ a row as a layout
def degrees(row: dict) -> dict:
    """tp, pp, vpp, cp, ep, dp of a row: dp is 2 only where ZeRO or ep needs data ranks that cp
    does not already give (the fewest ranks that exercise the row)."""
    tp = 1 if row["tp"] == "1" else TP
    pp = 1 if row["pipe"] == "none" else PP
    vpp = 2 if row["pipe"] in ("interleaved", "zbv", "dualpipev") else 1
    cp = int(row["cp"])
    ep = int(row["ep"])
    need_data = row["zero"] > 0 or ep > 1
    dp = 2 if need_data and cp == 1 else 1
    return {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "dp": dp}


def world_size(row: dict) -> int:
    d = degrees(row)
    return d["tp"] * d["pp"] * d["cp"] * d["dp"]


def model_overrides(row: dict) -> list[str]:
    """The overrides a row's one-rank reference shares with it (model, batch)."""
    moe = row["moe"]
    d = degrees(row)
    gb = row["micro_batch"] * MICROBATCHES.get(row["pipe"], 2) * d["dp"]
    ov = [f"model.n_layers={n_layers(row)}", f"model.tie_embeddings={str(row['tied']).lower()}",
          f"train.micro_batch={row['micro_batch']}", f"train.global_batch={gb}"] + FAMILY[row.get("family", "plain")]
    ov += MTP[row.get("mtp", 0)]
    if moe == "dense":
        return ov + ["model.moe.num_experts=0"]
    if moe == "group":
        return ov + [f"model.moe.num_experts={EXPERTS}", "model.moe.bias_update_rate=0.01"] + GROUP
    router = moe.replace("_cap", "")
    cap = CAPACITY if moe.endswith("_cap") else "null"
    return ov + [f"model.moe.num_experts={EXPERTS}", f"model.moe.router={router}", f"model.moe.capacity_factor={cap}",
                 "model.moe.bias_update_rate=0.01"]


def n_layers(row: dict) -> int:
    """The fewest layers that exercise the row (each layer costs ~10% of a row's CPU): 2 (a
    window layer and a full one, a dense first layer and an MoE one, one per stage of pp 2); 4
    with 4 chunks (pp 2 × vpp 2: one per chunk), with an uneven split of 2 chunks (1 + 3), and
    under recompute_every=2 with a pipeline (a recomputed layer on every stage); 8 for an uneven
    split of 4 chunks."""
    d = degrees(row)
    chunks = d["pp"] * (2 if d["vpp"] > 1 else 1)
    if row["pp_layout"] == "uneven" and d["pp"] > 1:
        return 8 if chunks == 4 else 4
    if chunks == 4 or (d["pp"] > 1 and row["recompute"] == "full" and row["recompute_every"] == 2):
        return 4
    return 2


def reference_key(row: dict) -> tuple:
    return tuple(model_overrides(row))


def overrides(row: dict) -> list[str]:
    """Every override of a row's layout (BASE and data.path excluded)."""
    d = degrees(row)
    pipe = row["pipe"]
    ov = model_overrides(row) + [f"parallel.{k}={v}" for k, v in d.items()]
    ov += [f"parallel.schedule={'1f1b' if pipe == 'none' else pipe}", f"parallel.zero={row['zero']}",
           f"parallel.recompute={row['recompute']}", f"parallel.recompute_every={row['recompute_every']}"]
    if row["tp"] != "1":
        ov += [f"parallel.sequence_parallel={str(row['tp'] != 'nosp').lower()}",
               f"parallel.tp_overlap={str(row['tp'] == 'overlap').lower()}"]
    if row["pp_layout"] == "uneven":
        chunks = d["pp"] * (2 if d["vpp"] > 1 else 1)
        ov.append("parallel.pp_layout=[" + ",".join(map(str, UNEVEN.get(chunks, [1, 1]))) + "]")
    return ov


def default_row() -> dict:
    """The first value of every feature: the base a refused pair is tried on."""
    return {n: v[0] for n, v in feature_values().items()}


# ------------------------------------------------------------------ a planner layout as a row
#: the keys of a planner layout that describe WHAT runs (mapped by :func:`planner_row`) ...
PLANNER_LAYOUT_KEYS = {"degrees", "schedule", "zero", "recompute", "recompute_every", "micro_batch",
                       "sequence_parallel", "tp_overlap", "pp_layout", "microbatches", "world_size", "overrides"}
#: ... and those that predict how it runs (no feature)
PLANNER_PREDICTION_KEYS = {"rank", "step_time_s", "tokens_per_s", "mfu", "bubble", "compute_s", "imbalance",
                           "imbalance_s", "recompute_s", "overhead_s", "bubble_s", "comm_s", "dp_comm_s",
                           "dp_exposed_s", "comm_time_s", "spans", "memory", "train_days", "device_hours",
                           "train_tokens", "train_tokens_from", "train_steps", "calibration", "gpu"}
#: the schema's parallel fields the features cover (dp is what is left of the world: derived)
PARALLEL_FIELDS = {"tp": "tp", "pp": "pipe", "vpp": "pipe", "schedule": "pipe", "cp": "cp", "ep": "ep",
                   "dp": None, "zero": "zero", "recompute": "recompute", "recompute_every": "recompute_every",
                   "sequence_parallel": "tp", "tp_overlap": "tp", "pp_layout": "pp_layout",
                   # null: dualpipev with ep > 1 runs overlapped, so the pipe feature's dualpipev rows with ep
                   # run it (tests/test_overlap.py proves it bit for bit against the serial order)
                   "pp_overlap": "pipe",
                   # null: flat on the suite's one node (node only where the ep group spans nodes); the
                   # dispatch by node against the flat one: tests/test_expert_node.py
                   "ep_dispatch": None}


def planner_row(layout: dict, model) -> dict:
    """The features of one layout from ``plan_layouts`` (any degree > 1 is the feature's "on"
    value), with the model's own (experts, router, capacity, tied embeddings)."""
    d = layout["degrees"]
    moe = model.moe
    if moe.num_experts == 0:
        moe_v = "dense"
    elif moe.n_group > 1:
        moe_v = "group"
    else:
        moe_v = moe.router + ("_cap" if moe.capacity_factor is not None else "")
    tp = "1" if d["tp"] == 1 else ("overlap" if layout["tp_overlap"] else "sp" if layout["sequence_parallel"]
                                   else "nosp")
    return {"pipe": "none" if d["pp"] == 1 else layout["schedule"], "recompute": layout["recompute"],
            "moe": moe_v, "tp": tp, "zero": int(layout["zero"]),
            "recompute_every": 1 if int(layout.get("recompute_every", 1)) == 1 else 2,
            "cp": 1 if d["cp"] == 1 else CP, "ep": 1 if d["ep"] == 1 else EP, "tied": bool(model.tie_embeddings),
            "pp_layout": "uneven" if layout.get("pp_layout") else "even",
            "micro_batch": 1 if int(layout["micro_batch"]) == 1 else 2,
            "family": ("mla" if model.mla.kv_lora_rank > 0 else "window" if model.sliding_window is not None
                       else "qwen3" if model.qk_norm else "plain"),
            "mtp": 1 if model.mtp.depth > 0 else 0}
