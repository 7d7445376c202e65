"""Run health: what keeps a long run honest and alive. The step loop's health calls (run_health.py:
profiler, per-rank timing and the straggler watch, the hang watchdog, goodput), the hang watchdog
itself (watchdog.py), loss spikes, non-finite steps and rollbacks (stability.py), a save before
SLURM ends the job (preempt.py), and no rank left training once its launcher is gone (orphans.py).

Nothing is imported here: the launcher reads the ranks' hang reports through watchdog.py without
the rank-side modules (torch, the metrics)."""
