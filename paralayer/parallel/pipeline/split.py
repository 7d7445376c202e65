"""The pipeline's layout: which layers each chunk holds, which pp rank runs it, and the split of
the (meta) model into this rank's chunks (:func:`split_model`).

Layout (the plan's convention, see docs/pipeline.md)
    ``plan["stage_layers"][c]`` lists the GLOBAL layer indices of pipeline chunk ``c`` (there are
    pp·v chunks). Chunk 0 also owns the embedding, the last chunk the final norm + head (+ loss).
    Which pp rank runs chunk ``c``:
      gpipe, 1f1b, interleaved   c % pp                (Megatron's looped/interleaved layout)
      zbv, dualpipev             c for c < pp, 2pp−1−c after (the "V": rank 0 holds the first
                                 and the last chunk; two chunks per rank, always)
    A chunk is the plain :class:`~paralayer.model.transformer.Transformer` with the other layers deleted and
    ``tok_embeddings`` / ``norm`` + ``output`` set to None where not owned, so parameter names are
    the same under every layout and :func:`paralayer.model.transformer.init_weights` gives the same weights.
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

from torch import nn

from paralayer.resolve.plan import plan_field

V_SCHEDULES = ("zbv", "dualpipev")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


# ------------------------------------------------------------------ layout (torch-free helpers)
def chunks_per_rank(schedule: str, vpp: int = 1) -> int:
    """Chunks each pp rank holds: vpp for gpipe/1f1b/interleaved (gpipe/1f1b want 1), 2 for V."""
    if schedule in V_SCHEDULES:
        return 2
    return max(1, int(vpp))


def chunk_to_rank(chunk: int, pp: int, schedule: str) -> int:
    """The pp rank that runs ``chunk`` (see the module docstring)."""
    if schedule in V_SCHEDULES:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(pp_rank: int, pp: int, n_chunks: int, schedule: str) -> list[int]:
    """Chunk indices held by ``pp_rank``, in pipeline order (ascending)."""
    return [c for c in range(n_chunks) if chunk_to_rank(c, pp, schedule) == pp_rank]


def auto_balance(n_layers: int, chunks: int, embed_cost: float = 1.0, head_cost: float = 1.0) -> list[int]:
    """Layers per chunk (contiguous, ≥ 1 each) minimising the most loaded chunk's cost.

    A layer costs 1; the embedding counts ``embed_cost`` layer-equivalents on chunk 0 and the final
    norm + head + loss ``head_cost`` on the last chunk (Megatron's
    ``account_for_embedding/loss_in_pipeline_split`` count one layer each, the default here).
    Ties go to the split closest to even. Examples: 6 layers on 4 chunks → [1, 2, 2, 1]
    (costs 2, 2, 2, 2); 8 layers on 4 chunks → [2, 2, 2, 2] (costs 3, 2, 2, 3; the unevener
    [1, 3, 3, 1] has the same maximum, 3, and loses the tie).
    """
    if chunks < 1 or n_layers < chunks:
        raise ValueError(f"cannot split {n_layers} layers into {chunks} chunks of at least one layer")
    extra = [0.0] * chunks
    extra[0] += embed_cost
    extra[-1] += head_cost
    even = n_layers / chunks
    # dp[c][n] = (max cost, squared deviation) best for the first c chunks holding n layers.
    INF = (float("inf"), float("inf"))
    best = [[INF] * (n_layers + 1) for _ in range(chunks + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(chunks + 1)]
    best[0][0] = (0.0, 0.0)
    for c in range(1, chunks + 1):
        for n in range(c, n_layers - (chunks - c) + 1):
            for k in range(1, n - (c - 1) + 1):
                prev = best[c - 1][n - k]
                if prev[0] == float("inf"):
                    continue
                cand = (max(prev[0], k + extra[c - 1]), prev[1] + (k - even) ** 2)
                if cand < best[c][n]:
                    best[c][n] = cand
                    choice[c][n] = k
    out, n = [], n_layers
    for c in range(chunks, 0, -1):
        k = choice[c][n]
        out.append(k)
        n -= k
    return out[::-1]


def default_stage_layers(n_layers: int, pp: int, vpp: int = 1, schedule: str = "1f1b",
                         pp_layout: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Global layer indices per pipeline chunk (pp·v chunks; v = 2 for zbv/dualpipev).

    ``pp_layout`` (layers per chunk, in chunk order) gives an explicit uneven split; without it
    the split is even when the layers divide, else :func:`auto_balance`. The first and the last
    chunk may hold 0 layers (the embedding alone, the norm + head (+ MTP) alone: the V schedules
    put both on rank 0, issue 45); a middle chunk needs at least one.
    """
    n_chunks = pp * chunks_per_rank(schedule, vpp)
    if pp_layout is not None:
        counts = [int(x) for x in pp_layout]
        if len(counts) != n_chunks or sum(counts) != n_layers or min(counts, default=0) < 0 \
                or any(k < 1 for k in counts[1:-1]):
            raise ValueError(f"parallel.pp_layout must list {n_chunks} layer counts summing to "
                             f"model.n_layers={n_layers}, at least 1 on every middle chunk, got {list(pp_layout)}")
    elif n_layers % n_chunks == 0:
        counts = [n_layers // n_chunks] * n_chunks
    else:
        counts = auto_balance(n_layers, n_chunks)
    out, start = [], 0
    for k in counts:
        out.append(list(range(start, start + k)))
        start += k
    return out


def plan_layout(plan: Any) -> tuple[int, str, list[list[int]]]:
    pp = int(plan_field(plan, "degrees")["pp"])
    schedule = str(plan_field(plan, "schedule"))
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    stage_layers = plan_field(plan, "stage_layers")
    if not stage_layers:
        raise ValueError("plan has no stage_layers (the resolver lists the layers of every pipeline chunk)")
    return pp, schedule, [list(map(int, s)) for s in stage_layers]


# ------------------------------------------------------------------ split
def split_model(model: nn.Module, plan: Any, pp_rank: int) -> list[nn.Module]:
    """This rank's pipeline chunks, in pipeline order: deep copies of the (meta) model holding
    only their layers; the embedding stays on chunk 0, norm + head on the last chunk.

    Each returned chunk carries ``pp_chunk`` (its global chunk index) for :class:`PipelineRunner`.
    """
    pp, schedule, stage_layers = plan_layout(plan)
    n_chunks = len(stage_layers)
    mine = rank_chunks(pp_rank, pp, n_chunks, schedule)
    if not mine:
        raise ValueError(f"pp rank {pp_rank} holds no chunk of {n_chunks} (pp={pp}, schedule={schedule})")
    chunks = []
    for c in mine:
        keep = {str(i) for i in stage_layers[c]}
        chunk = copy.deepcopy(model)
        for name in list(chunk.layers.keys()):
            if name not in keep:
                del chunk.layers[name]
        if c != 0:
            chunk.tok_embeddings = None
        if c != n_chunks - 1:
            chunk.norm = None
            chunk.output = None
            chunk.mtp = None
        elif getattr(chunk, "mtp", None) is not None:
            chunk.mtp.add_embedding_copy()  # MTP reads the embedding on the last stage (model/mtp.py)
        chunk.pp_chunk = c
        chunks.append(chunk)
    return chunks
