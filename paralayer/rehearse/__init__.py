"""The full-scale rehearsal: one real step of any rank of the full world, on a fake process group
and fake tensors (driver: choose ranks, spawn, compare with the plan; rank: the runtime's build and
step in one process; memory, comm, flops: what it measures; cli: the front door's tables;
fork_server: the preloaded server its ranks fork from, which the local launcher's ranks share)."""
from paralayer.rehearse.cli import preflight, print_report, run_cli  # noqa: F401
from paralayer.rehearse.driver import (  # noqa: F401
    MEM_KEYS,
    RANK_TIMEOUT_S,
    TOLERANCE,
    RanksError,
    compare,
    default_ranks,
    parse_ranks,
    plan_figures,
    rank_of,
    rehearsal_config,
    rehearsal_microbatches,
    rehearse,
    run_ranks,
)
