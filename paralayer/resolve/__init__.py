"""The torch-free resolver: config → rules → memory, cost → :class:`Plan`.

Why torch-free: a dry run (and the planner, which resolves thousands of layouts) must answer in
well under a second, and importing torch alone takes seconds.
"""
from paralayer.resolve.plan import Plan, resolve

__all__ = ["Plan", "resolve"]
