"""paralayer: declarative hybrid-parallel transformer training."""

__version__ = "0.1.0"
