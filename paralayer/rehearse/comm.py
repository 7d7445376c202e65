"""Every collective one rehearsed rank issues in its step: kind, mesh axis, message bytes, count.

Why a dispatch mode: torch routes both the c10d ops (``dist.all_reduce``, FSDP2's gathers, P2P
sends) and the functional collectives (DTensor redistribution, ``*_autograd``) through the
dispatcher, so one :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every one of
them, whoever issued it, without touching the code that issues them. DTensor ops are let through
first (``NotImplemented``, as torch's ``CommDebugMode`` does) so that their redistributions reach
the mode as the collectives they desugar into.

``message_bytes`` follows the plan's convention (resolve/cost/terms.py): one collective's payload, the
whole tensor of a gather or a scatter (the larger side), the buffer of an all-reduce, broadcast or
send, the input of an all-to-all.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

import torch

from paralayer.compat import private

TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode")
tree_flatten = private("torch.utils._pytree", "tree_flatten")

#: dispatcher op name (``c10d`` and ``_c10d_functional``) → the collective's kind
KINDS = {
    "allreduce_": "all-reduce", "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
    "allreduce_coalesced_": "all-reduce",
    "_allgather_base_": "all-gather", "allgather_": "all-gather", "all_gather_into_tensor": "all-gather",
    "allgather_into_tensor_coalesced_": "all-gather", "all_gather_into_tensor_coalesced": "all-gather",
    "all_gather_into_tensor_out": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter", "reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter",
    "alltoall_base_": "all-to-all", "alltoall_": "all-to-all", "all_to_all_single": "all-to-all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}
#: the output-side ops: sized by their larger tensor
_WIDE = {"all-gather", "reduce-scatter"}


def _nbytes(t: torch.Tensor) -> int:
    """The bytes a collective moves for ``t``. A float8 tensor of torchao (Float8TrainingTensor, as
    its tensor-parallel styles gather it) moves its FP8 ``_data`` (its scale is the whole tensor's,
    alike on every rank); the wrapper itself reads as its original dtype (4 bytes under autocast)."""
    data = getattr(t, "_data", None)
    if isinstance(data, torch.Tensor) and data is not t and isinstance(getattr(t, "_scale", None), torch.Tensor):
        t = data
    return int(t.numel()) * t.element_size()


def _group_name(args: list, known: dict) -> Optional[str]:
    """The group a collective runs on: a ProcessGroup argument (c10d ops) or its name (the
    functional collectives pass strings, the reduce op's name among them)."""
    names = []
    for a in args:
        if isinstance(a, str):
            names.append(a)
            continue
        name = getattr(a, "group_name", None)
        if name is None and isinstance(a, torch.ScriptObject):
            try:
                from torch.distributed.distributed_c10d import ProcessGroup

                name = ProcessGroup.unbox(a).group_name
            except Exception:  # noqa: BLE001
                name = None
        if isinstance(name, str):
            return name
    for n in names:
        if n in known:
            return n
    return names[-1] if names else None


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives by (axis, kind, message bytes) while active.

    ``axes`` maps a process group's name to the mesh axis it spans (``tp``, ``dp_cp``, ...); a
    group not in it is reported under its own name. Enter it INSIDE a FakeTensorMode so the fake
    tensors it sees are already the step's own.
    """

    def __init__(self, axes: dict[str, str], sizes: Optional[dict[str, int]] = None):
        super().__init__()
        self.axes = dict(axes)
        self.sizes = dict(sizes or {})
        self.dp_names: set = set()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            kind = KINDS.get(func._opname)
            if kind is not None and kind != "barrier":
                self._record(kind, list(args) + list(kwargs.values()))
        return func(*args, **kwargs)

    def _record(self, kind: str, args: list) -> None:
        flat, _ = tree_flatten(args)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        sizes = [_nbytes(t) for t in tensors]
        name = _group_name(flat, self.axes)
        if self.sizes.get(name) == 1:  # a one-rank group moves nothing
            return
        axis = self.axes.get(name, name or "?")
        if axis == "ep" and kind != "all-to-all" and name in self.dp_names:
            axis = "dp"  # ep spans all of dp·cp: the same group carries the gradient reduction
        if axis == "cp" and kind not in ("send", "recv") and name in self.dp_names:
            axis = "dp"  # dp = 1: the cp group is dp·cp's, and its reductions are the gradients'
        if kind == "all-gather" and len(tensors) == 1:  # functional: the output is not an argument
            msg = sizes[0] * self.sizes.get(name, 1)
        elif kind in _WIDE:
            msg = max(sizes)
        elif kind == "all-to-all":
            msg = sizes[1] if len(sizes) > 1 else sizes[0]  # (output, input)
        else:
            msg = sum(sizes)
        self.counts[(axis, kind, msg)] += 1

    def table(self) -> list[dict[str, Any]]:
        """The contract's rows: ``[{axis, kind, message_bytes, count}]``, largest traffic first."""
        rows = [{"axis": a, "kind": k, "message_bytes": int(b), "count": int(n)}
                for (a, k, b), n in self.counts.items()]
        return sorted(rows, key=lambda r: (-r["message_bytes"] * r["count"], r["axis"], r["kind"]))


#: Axes whose plan figure counts a ring's sends only (cp: each K/V block once, by its sender; tp
#: under tp_overlap); the pipeline's counts both directions of a stage boundary (resolve/cost/terms.py).
SENDS_ONLY = ("cp",)


def bytes_per_axis(rows: list[dict], pairs: Any = (), sends_only: Any = SENDS_ONLY) -> dict[str, int]:
    """Payload bytes per step on each axis (the plan's ``bytes_per_step``). On the axes in
    ``pairs`` an all-gather or reduce-scatter counts half: the plan counts the pair that replaces
    an all-reduce as that all-reduce's payload, once."""
    out: dict[str, float] = {}
    for r in rows:
        if r["axis"] in sends_only and r["kind"] == "recv":
            continue
        half = r["axis"] in pairs and r["kind"] in ("all-gather", "reduce-scatter")
        out[r["axis"]] = out.get(r["axis"], 0) + r["message_bytes"] * r["count"] * (0.5 if half else 1)
    return {k: int(v) for k, v in out.items()}


def group_sizes(meshes: Any, extra: Optional[dict] = None) -> dict[str, int]:
    """Process-group name → its size, for the groups of :func:`group_axes`."""
    import torch.distributed as dist

    out = {}
    for axis in ("dp_cp", "edp", "ep", "pp", "cp", "dp", "tp"):
        try:
            if axis in ("ep", "edp") and meshes.expert is None:
                continue
            g = meshes[axis].get_group()
            out[g.group_name] = dist.get_world_size(g)
        except Exception:  # noqa: BLE001
            continue
    for g in (extra or {}).values():
        out[g.group_name] = dist.get_world_size(g)
    return out


def group_axes(meshes: Any, extra: Optional[dict] = None) -> dict[str, str]:
    """Process-group name → mesh axis, for every axis of ``meshes`` (a :class:`Meshes`).

    A group that serves several axes (size-1 axes share nothing, but dp_cp equals dp when cp = 1)
    keeps the plan's name: dp for dp_cp and edp, the axis itself otherwise."""
    out: dict[str, str] = {}
    order = ["dp_cp", "edp", "pp", "cp", "dp", "ep", "tp"]  # later names win a shared group
    for axis in order:
        try:
            if axis in ("ep", "edp") and meshes.expert is None:
                continue
            mesh = meshes[axis]
            if mesh.size() <= 1:
                continue
            name = mesh.get_group().group_name
        except Exception:  # noqa: BLE001 - an axis this layout does not have
            continue
        out[name] = {"dp_cp": "dp", "edp": "dp"}.get(axis, axis)
    for name, axis in (extra or {}).items():
        out[name] = axis
    return out
