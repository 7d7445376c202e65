"""The cost model: what a layout costs per step and how long the step takes, torch-free.

``terms``: the pipeline bubble, FLOPs per token and per rank, communication per parallel axis
(re-exported here: ``paralayer.resolve.cost`` is their public face), with cp's entry in ``cp_ring``
and the entries' shape in ``entry``; ``comm_facts``: what the
communication reads of a layout's structure, cached per layout; ``split``: the layers over the
pipeline chunks and the work per rank; ``machine``: the device and links a step runs on;
``step_time``: one plan's step time and time to train.

A re-export is a name, not the function's home: patch (monkeypatch) the module that defines it.
"""
from paralayer.resolve.cost.cp_sends import window_sends  # noqa: F401 - re-exported
from paralayer.resolve.cost.terms import (  # noqa: F401 - re-exported: the cost model's API
    TP_PLAIN_MOE,
    TP_RINGS_DENSE,
    TP_RINGS_MOE,
    attn_core_flops_per_token,
    bubble_fraction,
    comm,
    cp_core_fraction,
    dp_comm,
    flops_per_token,
    group_routing_bound,
    layer_core_flops,
    plan_dp_entry,
    rank_flops,
    recompute_fraction,
    tp_overlap_comm,
    tp_plain_collectives,
    tp_ring_flops,
    window_core_fraction,
)
