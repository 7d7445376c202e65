"""RNG states (Python, torch CPU and CUDA, numpy) as plain types and tensors, so the per-rank extra
state of a checkpoint loads with ``torch.load(weights_only=True)``."""
from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict:
    """Python, torch (CPU and CUDA) and numpy RNG states as plain types + tensors."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                          float(cached))
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict) -> None:
    if "python" in state:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
