"""The token rows an ep rank sends, counted by destination: ``local`` (itself), ``intra_node``,
``inter_node``, what the plan's ``comm.ep`` splits (resolve/cost/ep_bytes.py). Both dispatches count
here (parallel/expert.py's flat all-to-all and parallel/expert_node.py's by node), so it sits apart
from either; a run's comm trace (parallel/comm_trace.py) holds the sums as ``bytes_sent["ep.<where>"]``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from paralayer.model.moe import MoEFeedForward


def byte_counter(m: MoEFeedForward) -> Optional[Callable[[list[int], int], None]]:
    """A callback ``(send splits per ep rank, bytes per row)`` adding to ``m.ep_bytes_sent`` by
    destination; None when the module has no node map (``m.ep_node_of``)."""
    node_of = getattr(m, "ep_node_of", None)
    if node_of is None:
        return None
    me = m.ep_rank
    tally = m.ep_bytes_sent
    trace = getattr(m, "ep_trace", None)  # the run's CommTrace (runtime/train.py): ep.<where> in bytes_sent

    def count(splits: list[int], row_bytes: int) -> None:
        for j, rows in enumerate(splits):
            where = "local" if j == me else "intra_node" if node_of[j] == node_of[me] else "inter_node"
            tally[where] += rows * row_bytes
            if trace is not None and rows:
                trace.sent("ep", where, rows * row_bytes)
    return count


def set_node_map(m: MoEFeedForward, node_of: list[int]) -> None:
    """Record which node each ep rank is on: the rows sent are then counted by destination."""
    if len(node_of) != m.ep_size:
        raise ValueError(f"node_of has {len(node_of)} entries for ep={m.ep_size}")
    m.ep_node_of = list(node_of)
    m.ep_bytes_sent = {"local": 0, "intra_node": 0, "inter_node": 0}
