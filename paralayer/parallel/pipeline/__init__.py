"""Pipeline parallel: the layout and the split of the model into chunks (split.py), the runner of
torch's schedules (runner.py) with what it hangs on each stage (stage_hooks.py) and the
rehearsal's static stages (rehearsal.py), early receives (early_recv.py), the V schedules' split
backward (split_backward.py), dualpipev's overlapped forward-backward (overlap.py), the measured
timeline (timeline.py) and the forward-only pass of evaluation (forward_only.py).

The names ``paralayer.parallel.pipeline`` always had are re-exported here; a test that replaces
one must patch the module that holds it (e.g. ``paralayer.parallel.pipeline.runner``), not this one."""
from paralayer.parallel.pipeline.runner import PipelineRunner
from paralayer.parallel.pipeline.split import (
    SCHEDULES,
    V_SCHEDULES,
    auto_balance,
    chunk_to_rank,
    chunks_per_rank,
    default_stage_layers,
    rank_chunks,
    split_model,
)

__all__ = ["SCHEDULES", "V_SCHEDULES", "PipelineRunner", "auto_balance", "chunk_to_rank", "chunks_per_rank",
           "default_stage_layers", "rank_chunks", "split_model"]
