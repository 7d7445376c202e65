"""The planner's memory fast path: the most loaded device of a layout for thousands of layouts a
second, from per-structure tables (states by ZeRO stage, activations per token by recompute mode,
microbatches in flight per candidate rank) instead of ``memory.memory()`` per layout.

Why it is its own module: the search (``planner``) asks it one question, "how many bytes on the
most loaded rank", and these are the resolver's own rules (``paralayer.resolve.memory``) summed in
the same order, so ``tests/test_planner.py`` can hold the two to the byte.
"""
from __future__ import annotations

from typing import Optional

from paralayer.config import Config
from paralayer.resolve import memory as mem_mod
from paralayer.resolve import model_parts as parts
from paralayer.resolve.cost.comm_facts import Memo
from paralayer.resolve.memory import interleaved_flight, muon_states, v_flight, zero1
from paralayer.resolve.memory.activations import KINDS, layer_kind, live_transient, rerun_extra
from paralayer.resolve.memory.chunk_tables import chunk_tables, fixed_bytes, mask_bytes_for
from paralayer.resolve.memory.states import chunk_blocks, rank_chunks
from paralayer.resolve.planner.comm import RECOMPUTES
from paralayer.resolve.planner.types import MemPick, RankInfo, Totals
from paralayer.resolve.rules import V_SCHEDULES, Layout

#: pipelines up to this depth have every rank weighed under the V schedules (candidate_ranks)
V_RANKS_ALL = 16


def candidate_ranks(cfg: Config, lay: Layout) -> list[RankInfo]:
    """The ranks that can be the most loaded: first, second, second to last, last; under the V
    and interleaved schedules every rank up to :data:`V_RANKS_ALL` (a rank's peak weighs its chunks
    by unequal in-flight counts, v_flight.moments and interleaved_flight.moments, so a middle rank
    can hold the most: llama3-70b pp8 vpp4 with recompute_every, rank 2 of 8, whose steady state
    holds 16 microbatches of each of its two heavier chunks). Built once per shape (the structures
    that differ in dp and cp share it; ZeRO-1's busiest data rank is dealt per dp·cp)."""
    key = (lay.tp, lay.pp, lay.vpp, lay.schedule, tuple(map(tuple, lay.stage_layers)), lay.ep, lay.sequence_parallel,
           lay.tp_overlap, lay.pp_overlap, lay.zero, lay.recompute, lay.recompute_every, lay.padded_vocab,
           lay.device, lay.precision, lay.devices_per_node, lay.cp == 1)  # cp: the window masks (_tables)
    cache = cfg.__dict__.setdefault("_candidate_ranks", Memo())  # kept on the config: its ranks' shapes
    if key not in cache:
        cache[key] = [(rk, tuple(sorted(zero1.dense_sizes(cfg, lay, rk.rank), reverse=True)))
                      for rk in _candidate_ranks(cfg, lay)]
    d = lay.dp * lay.cp
    return [rk._replace(zero1_dense=zero1.largest_load(sizes, d) * d if d > 1 else 0.0) for rk, sizes in cache[key]]


def _candidate_ranks(cfg: Config, lay: Layout) -> list[RankInfo]:
    """:func:`candidate_ranks` of a shape, without ZeRO-1's busiest data rank."""
    pp, schedule = lay.pp, lay.schedule
    ranks = []
    picked = {0, 1, pp - 2, pp - 1}
    if pp > 1 and schedule in V_SCHEDULES + ("interleaved",):
        # up to V_RANKS_ALL every rank; deeper pipelines (none published) the ends and every
        # pp // V_RANKS_ALL-th rank between, which may miss a middle rank's recompute_every mix
        picked |= set(range(0, pp, 1 if pp <= V_RANKS_ALL else pp // V_RANKS_ALL))
    if pp > 2 and schedule == "interleaved":
        # a rank whose chunks hold the same kinds of layers as the rank before it is dropped: each
        # of its backward moments holds no more of any chunk than one of the rank before's
        # (interleaved_flight.moments; tests/test_interleaved_flight.py checks p 2-16, v 2-4). Not
        # so under recompute_every > 1, whose recomputed layers differ by rank: docs/planner.md
        kinds = {r: (tuple(tuple(layer_kind(cfg, i) for i in blocks) for blocks in chunk_blocks(cfg, lay, r)),
                     _tables(cfg, lay, r)) for r in {x for q in picked for x in (q - 1, q) if 0 <= x < pp}}
        picked = {r for r in picked if r in (0, pp - 1) or kinds[r] != kinds[r - 1]}
    for r in sorted(picked & set(range(pp))):
        dense, expert, _ = mem_mod.rank_params(cfg, lay, r)
        chunks = rank_chunks(lay, r)  # not a walk over every chunk: O(pp) ranks under the V schedules
        layers = mem_mod.rank_layers(cfg, lay, r)  # with the MTP blocks on the last chunk's rank
        n_moe = sum(1 for i in layers if mem_mod.is_moe_layer(cfg, i))
        split, counts, il = (), (), ()
        if pp > 1 and schedule in V_SCHEDULES + ("interleaved",):
            per_chunk = tuple(tuple((i, layer_kind(cfg, i)) for i in blocks) for blocks in chunk_blocks(cfg, lay, r))
            counts = tuple(_chunk_counts(ch) for ch in per_chunk)
            split, il = (per_chunk, ()) if schedule in V_SCHEDULES else ((), per_chunk)
        held = tuple((i, layer_kind(cfg, i)) for i in layers)
        held, split, il = (_interned(cfg, x) for x in (held, split, il))
        ranks.append(RankInfo(r, dense, expert, len(layers) - n_moe, n_moe, (lay.chunks - 1) in chunks, held,
                              _tables(cfg, lay, r), split, counts, 0.0,
                              muon_states.muon_split(cfg, lay, r),
                              tuple(sum(1 for _, k in held if k == kind) for kind in range(len(KINDS))), il))
    return ranks


def _interned(cfg: Config, blocks: tuple) -> tuple:
    """One tuple object per value of a rank's (index, kind) blocks, kept on the config: shapes that
    differ only in what moves no layer (ep, the split's other ranks) then share the identity that
    :func:`_shared_layer_sums` keys its sums by."""
    return cfg.__dict__.setdefault("_rank_blocks", Memo()).setdefault(blocks, blocks)


def _tables(cfg: Config, lay: Layout, r: int) -> tuple:
    """Per chunk pipeline rank r holds, its (RoPE tables, window masks) (memory.chunk_tables)."""
    return tuple(chunk_tables(cfg, lay, lay.stage_layers[c], c == lay.chunks - 1) for c in rank_chunks(lay, r))


def act_tables(cfg: Config, act_cache: dict, lay: Layout, overlaps: tuple) -> dict:
    """(overlap, FSDP shards) -> {recompute: saved elements per token of each layer kind
    (memory.layer_kind: dense, MoE, and the two as Gated DeltaNet layers)};
    shared by the structures with the same keys act_elems_per_token depends on (bf16 keeps more
    in fp32 under autocast, ZeRO 0/1, than under FSDP's mixed precision: memory.bf16_extra_elems)."""
    acts = {}
    zero0 = lay.zero
    for overlap in overlaps:
        for fsdp in (False, True):
            lay.tp_overlap, lay.zero = overlap, (2 if fsdp else 0)
            # cp: ring attention's set, and a Gated DeltaNet layer's by the tokens per rank (linear_acts);
            # ep: the routed rows arrive in bf16 (memory.bf16_extra_elems)
            akey = (lay.tp, lay.sequence_parallel, lay.cp if cfg.model.linear.k_heads else lay.cp > 1, overlap,
                    fsdp and lay.dp * lay.cp > 1, lay.ep > 1)
            if akey not in act_cache:
                act_cache[akey] = {mode: tuple(mem_mod.kind_elems(cfg, lay, k, mode) for k in range(len(KINDS)))
                                   for mode in RECOMPUTES}
                # under cp a Gated DeltaNet layer's rule rerun by the layer's mode (memory.rerun_extra)
                act_cache[akey]["rerun"] = {mode: tuple(rerun_extra(cfg, lay, k, mode) for k in range(len(KINDS)))
                                            for mode in RECOMPUTES}
            acts[(overlap, fsdp)] = act_cache[akey]
    lay.tp_overlap, lay.zero = False, zero0
    return acts


def shared_memos(store: dict, lay: Layout, ranks: list[RankInfo]) -> tuple[dict, dict]:
    """A structure's (in_flight by (micro-batch, mode), each rank's activations by (micro-batch, mode,
    overlap, FSDP, recompute or k)), shared with the structures whose activations are the same: the
    key holds all that in_flight, the act tables and the peaks read of the layout (ep only as ep > 1:
    act_tables') and of each candidate rank (its blocks, chunks, tables, and the V ranks in_flight
    weighs as one group), so structures that differ in ep alone weigh them once. Kept in ``store``
    (the plan's act_cache) under ("activations", key)."""
    groups: dict = {}
    sig = tuple((rk.rank, rk.last, rk.layers, rk.split_chunks, rk.il_chunks, rk.chunk_counts, rk.tables, rk.kinds,
                 groups.setdefault((rk.dense, rk.expert, rk.last, rk.chunk_counts, rk.tables), rk.rank))
                for rk in ranks)
    key = ("activations", lay.tp, lay.cp, lay.dp, lay.pp, lay.vpp, lay.schedule, lay.sequence_parallel, lay.ep > 1,
           lay.padded_vocab, lay.precision, lay.device, tuple(map(tuple, lay.stage_layers)), sig)
    return store.setdefault(key, ({}, {}))


def table_bytes(cfg: Config, positions: float, mode: str) -> tuple[float, float]:
    """One RoPE table's and one window mask's bytes (memory.chunk_tables) in a ZeRO stage's mode."""
    return mem_mod.rope_bytes_for(parts.rope_dim(cfg), positions, mode), mask_bytes_for(positions, mode)


def in_flight(lay: Layout, ranks: list[RankInfo], mm: int, tokens: float, ab: int, h: int,
               rope: tuple, mode: str, head_passes: int = 1, mtp_elems: float = 0.0) -> list[tuple]:
    """Per candidate rank: (microbatches in flight, the bytes beside the layers' sets — each chunk's
    RoPE tables and window masks per microbatch in flight (``rope``: one table's and one mask's
    bytes, memory.chunk_tables), the logits and head per microbatch the last
    stage holds —, one microbatch's logits and head if it is last: memory.rank_activations).
    Under the V schedules (a rank with ``split_chunks``): (its backward passes' in-flight counts,
    v_flight.moments; the head's bytes; ``rope``): memory.v_rank_activations."""
    pp, schedule = lay.pp, lay.schedule
    out = []
    groups: dict = {}  # V ranks alike but for their order's counts: peak_memory weighs them as one
    for rk in ranks:
        head, one_pass = 0.0, 0.0
        if rk.last:
            head = 4 * tokens * lay.padded_vocab / lay.tp + mem_mod.head_saved_elems(lay, h, mode) * tokens * ab
            one_pass = head
            head *= head_passes  # 1 + model.mtp.depth (memory.rank_activations)
            head += mtp_elems * tokens * ab  # memory.mtp_saved_elems
        if rk.il_chunks:  # per chunk its microbatches at the worst backward (memory.rank_activations)
            sm = interleaved_flight.split_moments(pp, mm, lay.vpp, rk.rank)
            freed = one_pass if head_passes > 1 else head
            most = max(sum(held) for held in sm[0] + sm[1])  # the most chunk-microbatches held: a bound
            out.append((sm, head, _fixed(rk, rope), freed, None, most))
            continue
        if rk.split_chunks:
            mo = v_flight.moments(schedule, pp, mm, rk.rank)
            key = (rk.dense, rk.expert, rk.last, rk.chunk_counts, rk.tables)
            if key in groups:  # a follower: its counts join its group's leader's
                joined, owners = groups[key]
                joined += mo
                owners += [rk.rank] * len(mo)
                out.append((mo, head, _fixed(rk, rope), None))
            else:
                groups[key] = (list(mo), [rk.rank] * len(mo))
                out.append((mo, head, _fixed(rk, rope), groups[key]))
            continue
        inf = mem_mod.in_flight_count(pp, mm, schedule, lay.vpp, rk.rank)
        extra = inf * sum(_fixed(rk, rope))
        if rk.last:
            extra += head * (mm if (schedule == "gpipe" and pp > 1) else 1)
        # the head freed before a layer is recomputed; one pass with MTP (memory.rank_activations)
        out.append((inf, extra, one_pass if head_passes > 1 else head))
    return out


def _fixed(rk: RankInfo, rope: tuple) -> list:
    """Each chunk's RoPE tables and window masks in bytes (memory.chunk_fixed_bytes' sum), once per flight."""
    return [fixed_bytes(t, *rope) for t in rk.tables]


def _v_activations(rk: RankInfo, flight: tuple, per: list, split_t: list, full_t: list, tab: float,
                   group: Optional[tuple] = None) -> tuple[int, int]:
    """memory.v_rank_activations from the planner's tables, through memory.v_peak: per chunk its
    saved elements ``per`` (times ``tab``, plus RoPE's tables if it has layers), the head once, the
    pass's transient. ``group``: (moments, their ranks) of the ranks alike but for their counts
    (in_flight's groups), weighed in one pass. Returns (peak bytes, the rank holding it)."""
    own, head, fixed = flight[0], flight[1], flight[2]
    saved = [x * tab + f for x, f in zip(per, fixed)]
    moments, owners = group if group is not None else (own, None)
    peak, _, j = mem_mod.v_peak(moments, saved, head, [x * tab for x in split_t], [x * tab for x in full_t])
    return int(peak), (owners[j] if owners else rk.rank)


def peak_memory(ranks: list[RankInfo], states: list[tuple], flight: list[tuple], act: dict,
                 recompute: str, tab: float, memo: Optional[dict] = None, cap: Optional[float] = None) -> MemPick:
    """The most loaded of the candidate ranks for one (micro-batch, recompute, overlap). ``memo``:
    each rank's activations as computed here, kept by the caller per (flight, act, recompute, tab):
    the ZeRO stages that share those weigh the same activations beside other states. ``cap``: the
    device's capacity; the first rank over it is returned (the layout does not fit, whichever the
    most loaded: the caller reads only its total)."""
    es, full = act[recompute], recompute == "full"
    xr = act["rerun"][recompute]  # under cp a Gated DeltaNet rule's rerun by kind (memory.rerun_extra)
    rerun = any(xr)
    tr: list = []  # a fully recomputed block's transient, by kind (made where a rank needs it)
    best: Optional[tuple] = None
    for i, (rk, st, fl) in enumerate(zip(ranks, states, flight)):
        at = rk.rank
        hit = None if memo is None else memo.get(i)
        if hit is None and not tr:
            tr = [n - e + x for n, e, x in zip(act["none"], es, act["rerun"]["full"])]
        if hit is not None:
            a, at = hit
        elif rk.split_chunks:  # memory.v_rank_activations: the largest backward pass of the order
            if fl[3] is None:
                continue  # weighed with its group's leader (in_flight)
            cts = rk.chunk_counts
            per = [_dot(c, es) for c in cts]
            if full:
                a, at = _v_activations(rk, fl, per, [mem_mod.split_transient(c, tr) for c in cts],
                                       [_live(ch, act) for ch in rk.split_chunks], tab, fl[3])
            else:
                xs = [_largest(c, xr) for c in cts] if rerun else _ZEROS
                a, at = _v_activations(rk, fl, per, xs, xs, tab, fl[3])
        elif rk.il_chunks:  # memory.rank_activations: each chunk by its microbatches in flight
            # per chunk (memory.chunk_transients); under cp a rule's rerun, the rank's largest, beside each
            x = int(_largest(rk.kinds, xr) * tab) if rerun and not full else 0
            live = tuple(int(_live(ch, act) * tab) if full else x for ch in rk.il_chunks)
            per = _chunk_sets(rk, es)
            if best is not None and _il_bound(rk, fl, per, tab, live) + st[3] + st[10 if full else 9] <= best[0]:
                continue  # cannot be the most loaded: the walk over its moments is skipped
            a = _il_activations(rk, fl, per, tab, live)
        else:
            inf, extra, head = fl
            a = inf * _dot(rk.kinds, es) * tab + extra
            if full and (rk.n_dense + rk.n_moe):
                # the recomputed layer's set less its input and the sets above it (recompute_transient),
                # never live beside the same microbatch's logits and head (memory.rank_activations)
                live = int(_live(rk.layers, act) * tab)
                a += max(live - head, 0.0)
            elif rerun:  # a Gated DeltaNet rule's rerun, as the recomputed layer's (memory.recompute_transient)
                a += max(int(_largest(rk.kinds, xr) * tab) - head, 0.0)
        if hit is None:
            a = int(a)
            if memo is not None:
                memo[i] = (a, at)
        copies = st[11 if full and rk.split_chunks else (10 if full else 9)]  # autocast's copies: _rank_copies
        if best is None or st[3] + copies + a > best[0]:
            best = (st[3] + copies + a, at, st, copies, a)  # the MemPick is made once, for the winner
            if cap is not None and best[0] > cap:
                break
    assert best is not None
    total, at, st, copies, a = best
    return MemPick(total, at, st[0] + copies, st[1], st[2], a)


def _chunk_sets(rk: RankInfo, es: list) -> list:
    """Each chunk's saved elements per token (Σ count · elements), by the identity of the rank and
    the act table's row: the plan's micro-batches and overlaps weigh the same sums again."""
    key = (id(rk), id(es))
    hit = _CHUNK_SETS.get(key)
    if hit is None or hit[0] is not rk or hit[1] is not es:
        if len(_CHUNK_SETS) > 65536:
            _CHUNK_SETS.clear()
        hit = _CHUNK_SETS[key] = (rk, es, [_dot(c, es) for c in rk.chunk_counts])
    return hit[2]


_CHUNK_SETS: dict = {}


def _rank_copies(rk: RankInfo, st: tuple) -> tuple[int, int, int]:
    """A rank's autocast weight copies (memory.autocast_copy_params): unless fully recomputed (the
    head's and every layer's), fully recomputed (the head's or one layer's: a layer's are made again
    in its backward, never beside the same microbatch's head copy), and fully recomputed under a V
    schedule (a chunk's together, beside the head's)."""
    none, full = int(st[4] + _dot(rk.kinds, st[5:9])), int(max(st[4], _largest(rk.kinds, st[5:9])))
    return none, full, int(st[4] + max(_copies(c, st) for c in rk.chunk_counts)) if rk.split_chunks else full


def _dot(counts: tuple, elems: tuple) -> float:
    """Σ count · elements over the layer kinds, in kind order (memory.chunk_saved_elems' order)."""
    out = 0.0
    for n, e in zip(counts, elems):
        out += n * e
    return out


def _largest(counts: tuple, tr: list) -> float:
    """The largest of the kinds present (a recomputed layer's autocast copies: _rank_copies)."""
    return max((t for n, t in zip(counts, tr) if n), default=0.0)


def _live(blocks: tuple, act: dict, every: int = 1) -> float:
    """memory.live_transient of (index, kind) blocks under recompute=full on every ``every``-th one
    (under cp with a Gated DeltaNet layer's rerun: act["rerun"]["full"]), by the identity of the
    blocks (interned) and the act table: micro-batches and ZeRO stages reuse it."""
    key = ("live", id(blocks), id(act), every)  # in _CHUNK_SETS' bounded memo
    hit = _CHUNK_SETS.get(key)
    if hit is None or hit[0] is not blocks or hit[1] is not act:
        if len(_CHUNK_SETS) > 65536:
            _CHUNK_SETS.clear()
        hit = _CHUNK_SETS[key] = (blocks, act, live_transient([(k, i % every == 0) for i, k in blocks],
                                                          act["none"], act["full"], act["rerun"]["full"]))
    return hit[2]


def _copies(counts: tuple, st: tuple) -> float:
    """A chunk's autocast weight copies: kind k's st[5 + k] (memory.autocast_copy_params)."""
    return sum(n * w for n, w in zip(counts, st[5:9]))


def _il_activations(rk: RankInfo, flight: tuple, per: list, tab: float, live: tuple) -> int:
    """memory.rank_activations under the interleaved schedule from the planner's tables: each
    chunk's saved elements ``per`` times ``tab`` (plus RoPE's tables where it has layers) weighed by
    its microbatches at each backward (interleaved_flight.peak), the head with each microbatch the
    last chunk holds, and a recomputed layer's transient ``live`` (less the head at the last
    chunk's backward; one per chunk)."""
    split, head, fixed, freed = flight[:4]
    sets = [x * tab + f for x, f in zip(per, fixed)]
    sets[-1] += head  # with each microbatch the last chunk holds (memory.rank_activations)
    key = (id(split), tuple(sets), freed, live)
    hit = _IL_PEAKS.get(key)
    if hit is None or hit[0] is not split:  # split: the flight cache's own tuple
        if len(_IL_PEAKS) > 65536:
            _IL_PEAKS.clear()
        hit = _IL_PEAKS[key] = (split, int(interleaved_flight.peak(split, sets, freed, live)[0]))
    return hit[1]


#: :func:`_il_activations` by the identity of the split and its sets: structures that differ only
#: in what moves no activation (dp, ZeRO, the precision of the optimizer) weigh the same moments;
#: a bounded memo of pure results, as interleaved_flight._GROUPED
_IL_PEAKS: dict = {}


def _il_bound(rk: RankInfo, flight: tuple, per: list, tab: float, live: tuple) -> float:
    """An upper bound of :func:`_il_activations`: the most chunk-microbatches held at once times the
    heaviest chunk's set (in_flight's ``most``)."""
    heaviest = max(x * tab + f for x, f in zip(per, flight[2]))
    return flight[5] * (heaviest + flight[1]) + max(live)


def peak_memory_every(ranks: list[RankInfo], states: list[tuple], flight: list[tuple], act: dict,
                      every: int, tab: float, layer_sums: Optional[dict] = None,
                      shared_sums: Optional[dict] = None, memo: Optional[dict] = None,
                      cap: Optional[float] = None) -> MemPick:
    """``peak_memory`` for recompute=full on the layers i % every == 0 only (the others keep their
    "none" set; the recomputed layer's "none" set is live once: memory.recompute_transient).
    ``layer_sums``: a cache of the per-layer sums, which depend on ``act``, ``states`` and ``every``
    but not on the micro-batch (the caller keys it so; same sums, same order, same bytes).
    ``shared_sums``: a cache for one plan (its ``act`` tables live as long) of each rank's sums by
    its layers, act table, copy terms and ``every``: structures that share a split share them.
    ``memo``, ``cap``: as :func:`peak_memory`'s (the memo per flight, act, ``every``, tab)."""
    sums = None if layer_sums is None else layer_sums.get(every)
    if sums is None:
        sums = [_shared_layer_sums(rk, st, act, every, shared_sums) for rk, st in zip(ranks, states)]
        if layer_sums is not None:
            layer_sums[every] = sums
    best: Optional[tuple] = None
    for i, (rk, st, fl, (per, live, copies)) in enumerate(zip(ranks, states, flight, sums)):
        a = None if memo is None else memo.get(i)
        if a is not None:
            pass
        elif rk.split_chunks:  # per, live: per chunk (rank_layer_sums); each rank its own counts
            a = _v_activations(rk, fl, per, live[0], live[1], tab)[0]
        elif rk.il_chunks:  # per: per chunk (rank_layer_sums)
            live_il = tuple(int(x * tab) for x in live)
            if best is not None and _il_bound(rk, fl, per, tab, live_il) + st[3] + copies <= best[0]:
                continue  # cannot be the most loaded: the walk over its moments is skipped
            a = _il_activations(rk, fl, per, tab, live_il)
        else:
            inf, extra, head = fl
            a = int(inf * per * tab + extra + max(int(live * tab) - head, 0))
        if memo is not None:
            memo[i] = a
        if best is None or st[3] + copies + a > best[0]:
            best = (st[3] + copies + a, rk, st, copies, a)
            if cap is not None and best[0] > cap:
                break
    assert best is not None
    total, rk, st, copies, a = best
    return MemPick(total, rk.rank, st[0] + copies, st[1], st[2], a)


def _shared_layer_sums(rk: RankInfo, st: tuple, act: dict, every: int, shared: Optional[dict]) -> tuple:
    if shared is None:
        return rank_layer_sums(rk, st, act, every)
    # by the identity of the rank's layer tuples (candidate_ranks keeps them per shape), checked
    key = (every, id(act), st[4:9], id(rk.layers), id(rk.split_chunks), id(rk.il_chunks))
    hit = shared.get(key)
    if hit is None or hit[0] is not rk.layers or hit[1] is not rk.split_chunks or hit[2] is not rk.il_chunks:
        hit = shared[key] = (rk.layers, rk.split_chunks, rk.il_chunks, rank_layer_sums(rk, st, act, every))
    return hit[3]


def rank_layer_sums(rk: RankInfo, st: tuple, act: dict, every: int) -> tuple[float, float, int]:
    """(saved elements per token of the rank's layers, the recomputed layer's transient, autocast
    copies) under recompute=full on every ``every``-th layer (per chunk under interleaved and V)."""
    per, nf = 0.0, 0.0  # nf: under cp the largest rule rerun of a layer not fully recomputed
    copies, again = 0.0, 0.0  # autocast's copies held, and a recomputed layer's made again
    for i, kind in rk.layers:
        full = i % every == 0
        per += act["full" if full else "none"][kind]
        w = st[5 + kind]  # autocast's copies of the kind's weights
        if full:
            again = max(again, w)
        else:
            copies += w
            nf = max(nf, act["rerun"]["none"][kind])  # under cp (memory.recompute_transient)
    if rk.split_chunks:  # memory.v_rank_activations: per chunk its saved set and its passes' transients
        tr = [n - f + x for n, f, x in zip(act["none"], act["full"], act["rerun"]["full"])]
        pers = [_chunk_saved(ch, act, every) for ch in rk.split_chunks]
        cts = [_chunk_counts(ch, every) for ch in rk.split_chunks]
        live_v = ([mem_mod.split_transient(c, tr) for c in cts], [_live(ch, act, every) for ch in rk.split_chunks])
        # and a chunk's copies together, beside the head's (memory.autocast_copy_params)
        return pers, live_v, int(copies + (st[4] + max(_copies(c, st) for c in cts)))
    kept, il = int(copies + max(st[4], again)), rk.il_chunks  # memory.autocast_copy_params
    if il:  # memory.rank_activations: per chunk its saved set and its transient
        return [_chunk_saved(ch, act, every) for ch in il], [max(_live(ch, act, every), nf) for ch in il], kept
    return per, max(_live(rk.layers, act, every), nf), kept


_ZEROS = [0.0, 0.0]


def _chunk_saved(chunk: tuple, act: dict, every: int) -> float:
    """A chunk's saved elements per token under recompute=full on every ``every``-th block, summed
    by (MoE, mode) as memory.v_rank_activations sums them (the same order, the same bytes)."""
    kinds: dict = {}
    for i, kind in chunk:
        key = (kind, "full" if i % every == 0 else "none")
        kinds[key] = kinds.get(key, 0) + 1
    return sum(n * act[mode][kind] for (kind, mode), n in sorted(kinds.items()))


def _chunk_counts(chunk: tuple, every: int = 1) -> tuple[int, ...]:
    """A chunk's fully recomputed blocks by kind (memory.chunk_kind_counts)."""
    counts = [0] * len(KINDS)
    for i, kind in chunk:
        if i % every == 0:
            counts[kind] += 1
    return tuple(counts)


def state_table(ranks: list[RankInfo], lay: Layout, zero: int, tot: Totals,
                 copy_terms: Optional[tuple] = None, fp8_saving=None, fp8_copies=None) -> list[tuple]:
    """(params, grads, optimizer, total, head copy, then each layer kind's copy: dense, MoE, linear
    dense, linear MoE) bytes of each candidate rank under a ZeRO stage: the last five are autocast's
    bf16 weight copies (memory.autocast_copy_params; 0 unless bf16 runs under autocast at this
    stage), then the rank's copies by recompute mode that ``peak_memory`` adds (:func:`_rank_copies`).
    ``copy_terms``: memory.autocast_copy_terms(cfg, lay).
    ``fp8_saving``: rank → bytes FSDP's FP8 all-gather saves on its held weights (None at bf16).
    ``fp8_copies``: (rank, head bytes) → its copies unless fully recomputed and fully recomputed
    when its FP8 blocks keep fewer (planner/precision.py fp8_copies_fn; None at bf16)."""
    d_dense = lay.dp * lay.cp
    d_exp = max(d_dense // max(lay.ep, 1), 1)
    autocast = copy_terms is not None and \
        mem_mod.precision_mode(lay.precision, zero, d_dense) == "bf16-autocast"
    head, *kinds = (2 * x for x in copy_terms) if autocast else (0.0,) * (1 + len(KINDS))
    out = []
    for rk in ranks:
        pa, gr, op = (int(x) for x in mem_mod.state_bytes(rk.dense, rk.expert, d_dense, d_exp, zero, lay.pp,
                                                          lay.precision, lay.schedule))
        if zero == 1 and d_dense > 1:  # the busiest data rank's share, as memory.rank_memory
            op = int(mem_mod.state_bytes(rk.zero1_dense, rk.expert if lay.ep > 1 else 0.0, d_dense, d_exp, zero,
                                         lay.pp, lay.precision, lay.schedule)[2])
        op = int(muon_states.optimizer_bytes(op, rk.muon, lay, zero))
        if fp8_saving is not None:
            pa -= int(fp8_saving(rk))
        row = (pa, gr, op, pa + gr + op, head if rk.last else 0.0, *kinds)
        copies = _rank_copies(rk, row)
        if fp8_copies is not None and autocast:
            copies = (*fp8_copies(rk, row[4]), copies[2])  # a V chunk's transient keeps its base terms
        out.append(row + copies)  # [9:12]: peak_memory's copies by recompute
    return out

