"""What ``cost.comm`` reads of a layout's structure, computed once per layout object.

Why its own module: the planner calls ``cost.comm`` ~10⁴ times per ``--plan`` on a few hundred
layouts, changing only the micro-batch, the microbatch count, recompute and ZeRO between calls;
the parameters a pipeline rank holds, its layers and how many of them are MoE or fully recomputed
do not depend on those, and were the per-layer sums that cost the planner its margin (issue #37).
The values are the same functions' (``memory.rank_params``, ``rank_layers``), so the bytes are too.
"""
from __future__ import annotations

from typing import Optional

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory import is_moe_layer, layer_recompute, rank_chunks, rank_params
from paralayer.resolve.memory.states import input_pass_reruns, rank_layers
from paralayer.resolve.rules import V_SCHEDULES, Layout, chunk_rank


class Memo(dict):
    """A cache kept on a config or a layout. A copy starts empty: the copy may be changed (the no-fit
    search deep-copies the config per attempt), and copying the entries cost more than the plan."""

    def __deepcopy__(self, memo: dict) -> "Memo":
        return type(self)()

    def __copy__(self) -> "Memo":
        return type(self)()


def layout_cache(cfg: Optional[Config], lay: Layout, key: tuple) -> tuple[dict, tuple]:
    """The per-layout cache of :func:`cost.comm`'s structure facts: the planner calls comm ~10⁴ times
    per ``--plan`` on a few hundred layouts, varying only what these facts do not depend on
    (micro-batch, microbatches, recompute, ZeRO). Valid while the layout keeps its split and
    config (checked by identity; the entries hold both)."""
    cache = lay.__dict__.setdefault("_comm_facts", Memo())
    return cache, (id(cfg), lay.tp, lay.ep, lay.pp, lay.vpp, lay.schedule, lay.padded_vocab) + key


def rank_facts(cfg: Config, lay: Layout, r: int) -> tuple:
    """(dense params, expert params, layers held, their indices, MoE layers among them) of pipeline
    rank r: ``rank_params``, ``rank_layers`` and the MoE count, computed once per layout."""
    cache, key = layout_cache(cfg, lay, ("rank", r))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2]
    dense, expert, n_layers = rank_params(cfg, lay, r)
    layers = rank_layers(cfg, lay, r)
    facts = (dense, expert, n_layers, layers, moe_count(cfg, layers))
    cache[key] = (lay.stage_layers, cfg, facts)
    return facts


def rank_layer_facts(cfg: Config, lay: Layout, r: int) -> tuple:
    """(layers held, their indices, MoE layers among them) of pipeline rank r: :func:`rank_facts`
    without the parameter sums, which only the dp entry reads (the planner's per-rank traffic
    takes dp from rank 0), once per layout."""
    cache, key = layout_cache(cfg, lay, ("rank", r))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2][2:]
    cache, key = layout_cache(cfg, lay, ("layers", r))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2]
    layers = rank_layers(cfg, lay, r)  # rank_params' count: the chunks' layers and the MTP blocks
    facts = (len(layers), layers, moe_count(cfg, layers))
    cache[key] = (lay.stage_layers, cfg, facts)
    return facts


def recompute_facts(cfg: Config, lay: Layout, layers: list) -> tuple[int, int]:
    """(layers fully recomputed, MoE layers among them) of ``layers`` under the layout's recompute
    and recompute_every, once per (layout, layers, recompute, k). One rerun each per microbatch;
    the V schedules' second one is :func:`split_reruns`."""
    cache = config_cache(cfg)  # a function of the layers and the recompute alone: every layout's
    key = ("full", tuple(layers), lay.recompute, lay.recompute_every)
    facts = cache.get(key)
    if facts is None:
        full = [i for i in layers if layer_recompute(lay, i) == "full"]
        facts = cache[key] = (len(full), moe_count(cfg, full))
    return facts


def split_reruns(cfg: Config, lay: Layout, layers: list) -> dict:
    """{layer: forward reruns per step beyond one per microbatch}: a fully recomputed layer reruns
    its forward, and so its collectives (tp, the cp ring or its states, the ep all-to-alls), once
    more in the weight pass of each split backward of its chunk (memory.states.input_pass_reruns:
    m under ZB-V, affine like the rest; a count set by the chunk alone under DualPipeV, whose bytes
    go as 1/m at a fixed batch: planner/comm.py comm_line). Empty outside the V schedules or
    without full recompute."""
    if lay.recompute != "full" or lay.pp <= 1 or lay.schedule not in V_SCHEDULES or lay.microbatches <= 0:
        return {}
    cache, key = layout_cache(cfg, lay, ("reruns", tuple(layers), lay.recompute_every, lay.microbatches))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers and hit[1] is cfg:
        return hit[2]
    chunk_of = {i: c for c, ls in enumerate(lay.stage_layers) for i in ls}
    out = {}
    for i in layers:
        if layer_recompute(lay, i) == "full":
            extra = input_pass_reruns(lay.schedule, lay.pp, lay.microbatches, chunk_of.get(i, lay.chunks - 1))
            if extra:
                out[i] = extra
    cache[key] = (lay.stage_layers, cfg, out)
    return out


def moe_count(cfg: Config, layers: list) -> int:
    """How many of ``layers`` are MoE blocks: ``is_moe_layer`` of every block index, tabled once per
    config (its rule reads the config's model alone; the table lives in :func:`config_cache`)."""
    cache = config_cache(cfg)
    flags = cache.get("moe_flags")
    if flags is None:  # the blocks: the layers, then the MTP blocks (model_parts.mtp_layers)
        flags = cache["moe_flags"] = [int(is_moe_layer(cfg, i))
                                      for i in range(cfg.model.n_layers + cfg.model.mtp.depth)]
    return sum(map(flags.__getitem__, layers))


def config_cache(cfg: Config) -> dict:
    """A cache kept on the config of what depends on it and plain numbers only (the layers held,
    the recompute): the planner's layouts that share them share the entries."""
    return cfg.__dict__.setdefault("_comm_counts", Memo())


def chunk_facts(lay: Layout, r: int) -> tuple[bool, bool, int]:
    """(holds the first chunk, holds the last, pp transfers per microbatch: 2 across each boundary
    of its chunks with a neighbour chunk on another rank) of pipeline rank r, once per layout."""
    cache, key = layout_cache(None, lay, ("chunks", r))
    hit = cache.get(key)
    if hit is not None and hit[0] is lay.stage_layers:
        return hit[2]
    chunks = rank_chunks(lay, r)
    transfers = 0
    for c in chunks:
        for nb in (c - 1, c + 1):
            if 0 <= nb < lay.chunks and chunk_rank(nb, lay.pp, lay.schedule) != r:
                transfers += 2
    facts = (0 in chunks, (lay.chunks - 1) in chunks, transfers)
    cache[key] = (lay.stage_layers, None, facts)
    return facts


def tp_small_reduces(cfg: Config, lay: Layout, n_layers: int, last: bool, tokens: float) -> tuple[float, int]:
    """tp's small all-reduces per microbatch of a rank with ``n_layers`` blocks (bytes, count), each
    fp32, counted against the rehearsal's collectives (tests/test_rehearse_models.py):
    - the vocab-parallel loss's 3 statistics of the tokens, per head (the main one and each MTP
      depth's), on the last chunk;
    - under SP, each replicated weight's grad, which the sequence shards leave Partial: the block's
      norms, the final norm, and per MTP depth its three norms and its (d, 2d) projection M_k;
    - MLA (model/latent_attention.py, parallel/tensor/layout.py ``_latent_plan``), with or without
      SP: its down-projections q_a and kv_a and their norms run replicated, and the column GEMMs
      q_b and kv_b hand back their input grads Partial (each rank's heads' share). Each latent
      norm's backward sums that grad (tokens × its width), and the four weights' grads arrive
      Partial: 2 + 4 per layer (1 + 2 without a q down-projection)."""
    m = cfg.model
    d, depth = m.d_model, (m.mtp.depth if last else 0)
    small, count = 0.0, 0
    if last:
        small, count = 3 * tokens * 4 * (1 + depth), 3 * (1 + depth)
    if lay.sequence_parallel:
        norms = parts.layer_norm_count(cfg) * n_layers + int(last) + 3 * depth
        small += (norms * d + depth * 2 * d * d) * 4
        count += norms + depth
    if parts.attention_kind(cfg) == "mla":
        a = m.mla
        widths = [a.kv_lora_rank] + ([a.q_lora_rank] if a.q_lora_rank else [])
        weights = [(a.kv_lora_rank + a.qk_rope_head_dim) * d, a.kv_lora_rank]
        if a.q_lora_rank:
            weights += [a.q_lora_rank * d, a.q_lora_rank]
        small += n_layers * (tokens * sum(widths) + sum(weights)) * 4
        count += n_layers * (len(widths) + len(weights))
    return small, count


def with_embedding_sum(e: dict, cfg: Config, lay: Layout, r: int) -> dict:
    """The pp entry ``e`` of pipeline rank r plus, once per step, the all-reduce over its {first,
    last} pair that gives both copies of the embedding the sum of their fp32 gradients
    (parallel/tied_embeddings.py; ``embedding_sum_bytes_per_step``): tied embeddings, or MTP's copy
    on the last stage under pp; its tp slice of the vocabulary, its dp·cp shard under ZeRO 2/3.
    None on a rank that holds both copies (a V schedule's rank 0: a local add) or neither."""
    m = cfg.model
    if lay.pp == 1 or not (m.tie_embeddings or m.mtp.depth > 0):
        return e
    first, last, _ = chunk_facts(lay, r)
    if first == last:
        return e
    d = lay.dp * lay.cp
    nbytes = int(lay.padded_vocab / lay.tp * m.d_model * 4 / (d if lay.zero >= 2 and d > 1 else 1))
    return dict(e, count_per_step=e["count_per_step"] + 1, bytes_per_step=e["bytes_per_step"] + nbytes,
                embedding_sum_bytes_per_step=nbytes)


def linear_tp_delta(cfg: Config, lay: Layout, layers: list, fp8: tuple) -> tuple:
    """``fp8`` (``terms._tp_comm``'s tuple: pairs, bytes in ``act_msg``s, small bytes, small count per
    microbatch beyond its dense rule) plus what ``layers`` move beyond that rule as such a tuple.

    A Gated DeltaNet layer (parallel/tensor/layout.py ``_linear_plan``) takes its input through
    DTensor's PrepareModuleInput, not the SP GEMMs: under SP it all-gathers the input once and keeps
    it whole for backward, so it re-gathers nothing (−1 all-gather: −½ pair; its FFN still
    re-gathers). Its conv weight (channels·K) and its gated norm's gain (head_v_dim) are replicated
    and read by each rank's heads: their fp32 grads are all-reduced over tp per microbatch, with or
    without SP. Rehearsed tiny-qwen3.5 tp2: tp 0.933 of the plan before (counted as attention's), 1.000
    now. Not counted (as for every GQA layer with qk_norm): the q/k norms' grads (head_dim fp32 each,
    ``_replicate_over_heads``), all-reduced the same way: 512 B of 10.8 MB there."""
    if lay.tp == 1 or lay.tp_overlap:
        return fp8
    cache = config_cache(cfg)
    flags = cache.get("linear_flags")
    if flags is None:  # the blocks: the layers, then the MTP blocks (never linear)
        flags = cache["linear_flags"] = [int(parts.is_linear_layer(cfg, i))
                                         for i in range(cfg.model.n_layers + cfg.model.mtp.depth)]
    n_lin = sum(map(flags.__getitem__, layers))
    li = cfg.model.linear
    small, count = 0.0, 0
    if n_lin:
        channels = 2 * li.k_heads * li.head_k_dim + li.v_heads * li.head_v_dim
        small, count = n_lin * (channels * li.conv_kernel + li.head_v_dim) * 4.0, 2 * n_lin
    pairs = -0.5 * n_lin if lay.sequence_parallel else 0.0
    return fp8[0] + pairs, fp8[1] + pairs, fp8[2] + small, fp8[3] + count
