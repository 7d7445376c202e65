"""The V schedules' split backward (zbv, dualpipev) and recomputation.

torch's stages run a microbatch's backward as an input pass and, sometimes much later, a weight
pass (``stage.backward_maybe_with_nosync("input" | "weight")``). A recomputed region
(``paralayer.model.recompute``) reruns once per pass here: what its input pass made is dropped when
that pass ends, so a chunk-microbatch waiting for its weight pass holds only its inputs, and the
weight pass reruns the region once for all its parameter groups. The plan counts that second
rerun (``resolve/memory_states.py: input_pass_reruns``).
"""
from __future__ import annotations

from typing import Any

from paralayer.model import recompute


def drop_recompute_after_input_pass(stage: Any) -> None:
    """Wrap ``stage``'s backward so that the input pass's recomputed tensors go with it."""
    base = stage.backward_maybe_with_nosync

    def backward(backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "input":
            return base(backward_type, bwd_kwargs, last_backward=last_backward)
        with recompute.dropped_after():
            return base(backward_type, bwd_kwargs, last_backward=last_backward)

    stage.backward_maybe_with_nosync = backward
