"""Tensor parallel: the layout of every module under tp (layout.py), the vocab-parallel loss
(loss.py), sequence parallel's GEMMs that save the shard (sequence_parallel.py), the collectives
overlapped with the GEMMs (tp_overlap.py), and which gradients the running backward pass asks of
a fused GEMM (backward_pass.py).

The names ``paralayer.parallel.tensor`` always had are re-exported here; a test that replaces
one must patch the module that holds it (e.g. ``paralayer.parallel.tensor.layout``), not this one."""
from paralayer.parallel.local_shard import local_tensor
from paralayer.parallel.tensor.layout import (
    align_grad,
    apply_tensor_parallel,
    check_tp_shapes,
    full_grads,
    local_param_bytes,
)
from paralayer.parallel.tensor.loss import loss_parallel_ctx, tp_loss

__all__ = ["align_grad", "apply_tensor_parallel", "check_tp_shapes", "full_grads", "local_param_bytes",
           "local_tensor", "loss_parallel_ctx", "tp_loss"]
