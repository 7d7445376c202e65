"""The layout planner (``--plan``): every valid layout for a model on a cluster, ranked by the cost
model's step time, torch-free.

``search``: the walk over the layout space and the ranking (re-exported here:
``paralayer.resolve.planner`` is its public face); ``bounds``: the lower bounds that skip what
cannot win; ``memory`` and ``comm``: the memory and traffic fast paths; ``lazy_lines``: traffic
lines on first use; ``types``: the records; ``rows``: a weighed layout as a listed row;
``report``: the table and JSON; ``no_fit``: the nearest layouts when none fits; ``gc_pause``.

A re-export is a name, not the function's home: patch (monkeypatch) the module that defines it.
"""
from paralayer.resolve.planner.search import (  # noqa: F401 - re-exported: the planner's API
    LOCAL_CALIBRATION,
    MAX_CANDIDATES,
    MAX_STRUCTURES,
    MAX_VPP,
    SCHEDULES_PP,
    MemPick,
    balanced_split,
    best_split,
    comm_seconds,
    config_for,
    layer_work,
    machine_for,
    plan_layouts,
    predict,
    rank_work,
    wire_factor,
)
