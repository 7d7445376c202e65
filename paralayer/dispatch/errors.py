"""The one error a launch raises when a run cannot start as planned (its own module, so that
dispatch/__init__ and the SLURM dispatcher both use it without importing each other)."""
from __future__ import annotations


class LaunchError(RuntimeError):
    """A run that cannot start as planned (no CUDA device for a cuda plan, sbatch refused it):
    the front door prints its one-line message and exits 2; nothing was started."""


class DispatchError(LaunchError):
    """Bad cluster settings or run directories, or sbatch refused the job (one line)."""
