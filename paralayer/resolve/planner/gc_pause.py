"""The cyclic garbage collector paused around a search that only makes short-lived acyclic objects.

Why: ``planner.plan_layouts`` makes and frees ~10⁶ small tuples and dicts; the collector's passes
over them cost ~10% of ``--plan`` here (issue #37) and find nothing the search needs freed. What
is cyclic is collected once the collector is back on; its state is restored as it was.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
