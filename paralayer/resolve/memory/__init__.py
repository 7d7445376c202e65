"""The memory model: bytes per device for a layout, torch-free (the resolver and the planner).

One concept per module, all re-exported here (``paralayer.resolve.memory`` is the public face):
model states — parameter counts, what each pipeline rank holds, ZeRO's sharding, bytes per
parameter by precision — in ``states``; the bf16 weight copies autocast keeps in ``autocast``;
activations (saved sets, microbatches in flight, RoPE tables, the head, full recompute's
transient; the measured constants and their sources) in ``activations``, what bf16 keeps in fp32
in ``bf16_acts``, the Gated DeltaNet layer's set in ``linear_acts``, with the V schedules'
in-flight counts in ``v_flight`` and the interleaved schedule's per chunk in
``interleaved_flight``; ZeRO-1's exact share per data rank in ``zero1``; the per-rank
sum and the most loaded rank in ``total``.

A re-export is a name, not the function's home: patch (monkeypatch) the module that defines it.
"""
from paralayer.resolve.memory.activations import (  # noqa: F401 - re-exported: the memory model's API
    KINDS,
    act_elems_per_token,
    chunk_saved_elems,
    head_saved_elems,
    in_flight,
    in_flight_count,
    kind_elems,
    layer_kind,
    mtp_saved_elems,
    rank_activations,
    recompute_transient,
    rope_bytes,
    rope_bytes_for,
    split_transient,
    v_peak,
)
from paralayer.resolve.memory.autocast import autocast_copy_params, autocast_copy_terms  # noqa: F401
from paralayer.resolve.memory.bf16_acts import bf16_extra_elems, routed_rows_per_token  # noqa: F401
from paralayer.resolve.memory.states import (  # noqa: F401 - re-exported: the memory model's API
    ACT_BYTES,
    BYTES_PER_PARAM,
    HELD_BYTES,
    attn_params,
    expert_params,
    is_moe_layer,
    layer_params,
    layer_recompute,
    matmul_params,
    parameter_counts,
    precision_mode,
    rank_chunks,
    rank_layers,
    rank_params,
    state_bytes,
)
from paralayer.resolve.memory.total import GIB, Memory, gib, memory, rank_memory  # noqa: F401

__all__ = ["Memory", "memory", "parameter_counts", "matmul_params", "rank_memory", "rank_activations", "in_flight",
           "autocast_copy_params", "autocast_copy_terms",
           "act_elems_per_token", "rank_chunks", "is_moe_layer", "layer_recompute"]
