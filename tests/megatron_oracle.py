"""Megatron-core's indexed dataset classes, the oracle of the indexed data format, imported on first
use: megatron.core imports torch._dynamo and torch._inductor (~9 CPU-s), which every xdist worker
paid at collection when the test files imported it at their top."""
from __future__ import annotations

import warnings


def megatron(*names: str):
    """The named classes of ``megatron.core.datasets.indexed_dataset`` (one name: the class)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    got = tuple(getattr(indexed_dataset, n) for n in names)
    return got[0] if len(got) == 1 else got
