"""The run loop: the training step and schedule (train.py), building a rank (build.py), its
checkpoints (rank_checkpoints.py), MoE and MTP step statistics, evaluation, activation accounting,
and run health (health/: watchdog, stability, preemption, orphans)."""
