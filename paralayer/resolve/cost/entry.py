"""One axis's traffic as ``cost.comm`` gives it (plan JSON ``comm.<axis>``), and what every axis's
entry reads of the precision.

Why its own module: cost/terms.py builds tp, pp, ep and dp, cost/cp_ring.py cp; both make entries
the same way. Torch-free."""
from __future__ import annotations

from paralayer.resolve.memory import precision_mode
from paralayer.resolve.rules import Layout


def entry(collective: str, message: float, count: float, group: int) -> dict:
    message, count = int(message), int(count)
    return {"collective": collective, "message_bytes": message, "count_per_step": count,
            "bytes_per_step": message * count, "group_size": group}


def with_reruns(e: dict, count: float, nbytes: float) -> dict:
    """``e`` with the share of its traffic the split backwards' second reruns move (``split_reruns``):
    ``split_rerun_count_per_step`` and ``split_rerun_bytes_per_step``, where there are any. Under
    DualPipeV their count is set by the chunks alone, so their bytes go as the micro-batch, 1/m at a
    fixed batch: the planner's lines (planner/comm.py) take them apart from the affine rest."""
    if count:
        e["split_rerun_count_per_step"], e["split_rerun_bytes_per_step"] = int(count), int(nbytes)
    return e


def exchanges(e: dict) -> int:
    """The ep entry's dispatch and combine exchanges per step (what the overlapped pairs carry, two
    per MoE layer and half): its all-to-alls, or half of them under the two-stage dispatch by node
    (``dispatch`` node: each exchange is a network stage and an NVLink stage)."""
    return e["count_per_step"] // 2 if e.get("dispatch") == "node" else e["count_per_step"]


def autocast(lay: Layout) -> bool:
    """bf16 as autocast runs it: fp32 weights and residual stream, bf16 GEMMs (memory.precision_mode)."""
    return precision_mode(lay.precision, lay.zero, lay.dp * lay.cp) == "bf16-autocast"
