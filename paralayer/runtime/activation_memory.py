"""Live bytes of the tensors autograd saves for backward, and their peak: how the activation
figures of the plan are checked against the runtime (tests, benchmarks/calibrate.py)."""
from __future__ import annotations

import torch

from paralayer.compat import dtensor_local


class ActivationMemory:
    """Live bytes of tensors saved for backward (``saved_tensors_hooks``), and their peak.

    Tensors in ``exclude`` (the parameters, the step's tokens and labels — not activations) and
    views of them are skipped; a storage saved several times counts once (its whole size); bytes
    are released when autograd frees the saved tensor (after the backward — for zero-bubble
    schedules after the weight-grad pass)::

        with ActivationMemory([*model.parameters(), tokens, labels]) as mem:
            runner.step(tokens, labels)
        mem.peak_bytes
    """

    def __init__(self, exclude=()):
        self.param_ptrs = set()
        for p in exclude:
            t = p.to_local() if hasattr(p, "to_local") else p
            self.param_ptrs.add(t.untyped_storage().data_ptr())
        self.live = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}
        self._ctx = None

    def _pack(self, t):
        base = dtensor_local(t)
        try:
            st = base.untyped_storage()
        except Exception:  # noqa: BLE001 - e.g. sparse / meta: not counted
            return t
        ptr = st.data_ptr()
        if ptr in self.param_ptrs or st.nbytes() == 0:
            return t
        n = self._refs.get(ptr, 0)
        if n == 0:
            self.live += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self._refs[ptr] = n + 1
        # hold a detached alias: holding ``t`` itself would tie a saved OUTPUT to its own grad_fn
        # (node → packed object → tensor → node), a cycle through C++ that Python's gc cannot see,
        # and the bytes would never be released when the graph goes
        return _Saved(t.detach(), ptr, st.nbytes(), self)

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Saved) else x

    def _release(self, ptr: int, nbytes: int) -> None:
        n = self._refs.get(ptr, 0) - 1
        if n <= 0:
            self._refs.pop(ptr, None)
            self.live -= nbytes
        else:
            self._refs[ptr] = n

    def reset_peak(self) -> None:
        self.peak_bytes = self.live

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


class _Saved:
    __slots__ = ("t", "ptr", "nbytes", "owner")

    def __init__(self, t, ptr, nbytes, owner):
        self.t, self.ptr, self.nbytes, self.owner = t, ptr, nbytes, owner

    def __del__(self):
        try:
            self.owner._release(self.ptr, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
