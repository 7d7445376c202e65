"""The FLOPs one rehearsed rank executes in its step, counted by torch's ``FlopCounterMode``.

Two additions to torch's counter: DTensor ops are let through first (their local ops are what the
device runs; counting the DTensor op would count the global shape on every rank), and so are the
meta-tensor ops of DTensor's sharding propagation, and the CPU
attention kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what the
rehearsal dispatches to here) get the formulas torch gives their CUDA twins; a grouped conv's
backward is counted per group (torch's formula counts its weight gradient ``groups`` times) and a
triangular solve, which torch leaves out, as n² a column.
"""
from __future__ import annotations

from math import prod

import torch
from torch.utils import flop_counter as fc


class _LocalFlopMode(fc._FlopCounterMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        if self.counter.propagating or _foreign(args, self.counter.fake_mode):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _foreign(args, fake_mode) -> bool:
    """True when the op's first tensor is meta or belongs to another FakeTensorMode than the step's."""
    from paralayer.compat import private

    FakeTensor = private("torch._subclasses.fake_tensor", "FakeTensor")

    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, torch.Tensor):
            if a.device.type == "meta":
                return True
            return fake_mode is not None and isinstance(a, FakeTensor) and a.fake_mode is not fake_mode
    return False


def _cpu_attention_mapping() -> dict:
    aten = torch.ops.aten
    out = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    for op, formula in ((fwd, fc.sdpa_flop), (bwd, fc.sdpa_backward_flop)):
        if op is not None:
            out[op] = _raw(formula)
    out[aten.convolution_backward] = _raw(fc.shape_wrapper(conv_backward_flop))
    out[aten.linalg_solve_triangular] = _raw(fc.shape_wrapper(solve_triangular_flop))
    return out


def conv_backward_flop(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                       output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    """torch's formula (2.13) with its weight gradient divided by ``groups``: it counts that part
    as a conv over every input channel, ``groups`` times the work (the depthwise conv before the
    delta rule, groups = channels: 8,192 times at Qwen3.5's widths). The input gradient is right."""
    args = (grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding, groups)
    torch_formula = fc.conv_backward_flop.__wrapped__  # registered wrapped in shape_wrapper
    n = torch_formula(*args, [output_mask[0], False, False], out_shape=out_shape)
    if output_mask[1]:
        n += torch_formula(*args, [False, True, False], out_shape=out_shape) // max(int(groups), 1)
    return n


def solve_triangular_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A triangular solve with an n × n matrix: n² FLOPs a right-hand column (n²/2 multiply-adds),
    numel(out) · n over the batch; torch has no formula (the chunked delta rule's UT transform,
    model/linear/delta_rule.py, and its backward's solve with the transposed matrix)."""
    return prod(out_shape) * int(a_shape[-1])


def _raw(formula):
    """torch's registered formulas already take tensors (``shape_wrapper``): mark them raw so the
    counter does not wrap them a second time."""
    def f(*args, **kwargs):
        return formula(*args, **kwargs)

    f._get_raw = True
    return f


class LocalFlopCounter(fc.FlopCounterMode):
    """``FlopCounterMode`` that counts each rank's local work (see the module docstring)."""

    def __init__(self, fake_mode=None) -> None:
        super().__init__(display=False, custom_mapping=_cpu_attention_mapping())
        self.fake_mode = fake_mode
        self.propagating = 0
        self._restore = None

    def _watch_propagation(self) -> None:
        """DTensor's sharding propagation runs each new op once more on fake tensors of the GLOBAL
        shape, to learn the output's shape: work no device does, so it is not counted."""
        try:
            from paralayer.compat import CompatError, private

            ShardingPropagator = private("torch.distributed.tensor._sharding_prop", "ShardingPropagator")
        except CompatError:  # pragma: no cover - other torch versions
            return
        name = "_propagate_tensor_meta_non_cached"
        orig = getattr(ShardingPropagator, name, None)
        if orig is None:  # pragma: no cover
            return
        counter = self

        def wrapped(*args, **kwargs):
            counter.propagating += 1
            try:
                return orig(*args, **kwargs)
            finally:
                counter.propagating -= 1

        setattr(ShardingPropagator, name, wrapped)
        self._restore = lambda: setattr(ShardingPropagator, name, orig)

    def __exit__(self, *args):
        try:
            b = self.mode.__exit__(*args)
            self.mode = None
            return b
        finally:
            if self._restore is not None:
                self._restore()
                self._restore = None

    def __enter__(self):
        # No per-module breakdown: torch's ModuleTracker hooks module inputs for the backward,
        # which the zero-bubble schedules' input-grad pass (autograd.grad on leaves) refuses.
        self._watch_propagation()
        self.flop_counts.clear()
        self.mode = _LocalFlopMode(self)
        self.mode.__enter__()
        return self
