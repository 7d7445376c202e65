"""The run loop: the training step and schedule (train.py), MoE step statistics, preemption, activation accounting."""
