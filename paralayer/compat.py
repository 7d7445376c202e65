"""Every private torch API paralayer touches, and every API newer than the oldest torch we run.

Why one module: private names (a leading underscore, ``torch.testing._internal``, the pipeline
stage's per-chunk methods) move between torch releases without notice. Reaching them only from
here means a torch upgrade breaks in one place, with a message that names the API and the torch
version, instead of an AttributeError deep inside a rank. APIs newer than torch 2.11 (the GPU box's
torch; CI runs 2.13) come with a fallback that tests exercise on CPU by hiding the new API.

Nothing here imports torch at module import beyond ``torch`` itself; each accessor looks its
target up when called, so a missing private API fails only the feature that needs it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch


class CompatError(RuntimeError):
    """A private torch API paralayer relies on is missing from the installed torch."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, e.g. (2, 13)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _missing(what: str, hint: str = "") -> CompatError:
    return CompatError(f"paralayer needs {what}, which torch {torch.__version__} does not have"
                       f"{'; ' + hint if hint else ''} (paralayer is tested on torch 2.13 and, on GPUs, 2.11; "
                       f"see paralayer/compat.py)")


def _attr(obj: Any, name: str, what: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(what) from None


# ------------------------------------------------------------------ private APIs (no public equivalent)
def flatten_mesh(mesh: Any, name: str) -> Any:
    """``DeviceMesh._flatten``: one named 1-D mesh over several axes (dp·cp), a submesh that
    shares the parent's process groups (torchtitan does the same)."""
    return _attr(mesh, "_flatten", "DeviceMesh._flatten (flattening mesh axes)")(name)


def dtensor_local(t: Any) -> Any:
    """The local shard of a DTensor without going through autograd (``DTensor._local_tensor``);
    a plain tensor is returned as is. For reading storage, never for computing gradients."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    return _attr(t, "_local_tensor", "DTensor._local_tensor")


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (recomputation re-enters forward
    there); ``torch._C._current_graph_task_id`` is -1 outside a backward."""
    fn = _attr(torch._C, "_current_graph_task_id", "torch._C._current_graph_task_id")
    return fn() != -1


def is_view(t: Any) -> bool:
    """``Tensor._is_view``: whether ``t`` shares another tensor's storage through autograd's view
    tracking (the zero-bubble schedules ``detach_()`` stage outputs, which autograd refuses on views)."""
    return isinstance(t, torch.Tensor) and _attr(t, "_is_view", "Tensor._is_view")()


def aten_op(name: str) -> Callable[..., Any]:
    """A private aten operator (``torch.ops.aten._scaled_dot_product_*``): ring attention needs
    the attention kernels' log-sum-exp output and their backward, which only these ops expose."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        raise _missing(f"the aten operator {name}") from None


#: the pipeline stage's per-chunk methods the runner times (``torch.distributed.pipelining``
#: internals: the schedules call them once per action)
STAGE_ACTIONS = {"F": "forward_one_chunk", "B": "backward_one_chunk", "W": "backward_weight_one_chunk"}


def stage_action_methods(stage: Any) -> dict[str, str]:
    """The per-action method names of a ``PipelineStage``, checked to exist on this torch."""
    for name in STAGE_ACTIONS.values():
        if not callable(getattr(stage, name, None)):
            raise _missing(f"PipelineStage.{name} (the pipeline runner times each action through it)")
    return dict(STAGE_ACTIONS)


def fake_store() -> Any:
    """``FakeStore`` for a fake process group (``torch.testing._internal.distributed.fake_pg``):
    one real rank's step at the full world size with no peers (rehearsal)."""
    try:
        mod = importlib.import_module("torch.testing._internal.distributed.fake_pg")
    except ImportError:
        raise _missing("torch.testing._internal.distributed.fake_pg") from None
    return _attr(mod, "FakeStore", "torch.testing._internal.distributed.fake_pg.FakeStore")()


#: private modules and names reached by path: (module, attribute or None for the module itself)
PRIVATE_NAMES = (
    ("torch.distributed._functional_collectives", None),          # parallel/tensor/sequence_parallel.py
    ("torch.distributed.pipelining._backward", "stage_backward"),  # parallel/pipeline/stage_hooks.py
    ("torch.distributed.pipelining._utils", "InferenceMode"),      # parallel/pipeline/rehearsal.py
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),           # rehearse/rank.py
    ("torch._subclasses.fake_tensor", "FakeTensor"),               # rehearse/flops.py
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),  # rehearse/flops.py
    ("torch.utils._python_dispatch", "TorchDispatchMode"),         # rehearse/comm.py
    ("torch.utils._pytree", "tree_flatten"),                       # rehearse/comm.py
    ("torch", "_foreach_norm"),                                    # parallel/data.py (clip)
    ("torch", "_foreach_mul_"),                                    # parallel/data.py (clip)
    ("torch._dynamo.utils", "counters"),                           # tests/test_compile.py
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),  # checkpoint/hf.py
    ("torch._C", "_will_engine_execute_node"),                     # parallel/tensor/backward_pass.py
)


def private(module: str, name: Optional[str] = None) -> Any:
    """A private torch module (``name`` None) or a name in it, listed in PRIVATE_NAMES; a clear
    CompatError naming it and the torch version when this torch lacks it."""
    if (module, name) not in PRIVATE_NAMES:
        raise ValueError(f"{module}.{name} is not a registered private API: add it to PRIVATE_NAMES")
    what = module if name is None else f"{module}.{name}"
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise _missing(what) from None
    return mod if name is None else _attr(mod, name, what)


def release_mesh_groups() -> int:
    """After ``destroy_process_group``: empty every DeviceMesh's ``_pg_registry`` (a private
    instance attribute of torch 2.13's DeviceMesh, absent on older torch: nothing to do there).

    Why: destroy forgets the process groups, but a mesh keeps its groups in that dict and DTensor's
    sharding caches keep the meshes for the life of the process, so the groups' C++ objects, and
    the native threads each gloo group runs, lived on into interpreter finalization (issue 48).
    Only for a process that is ending: a cached mesh equal to a later one would then have no
    groups. Returns how many meshes held groups."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    n = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):  # type(), not isinstance: no __class__ lookups on proxies
            registry = getattr(obj, "_pg_registry", None)
            if registry:
                registry.clear()
                n += 1
    return n


def release_default_arguments() -> int:
    """After ``destroy_process_group``: drop the process groups that torch's
    ``torch.distributed.nn.functional`` holds as default arguments. Returns how many it dropped.

    Why: its functions are written ``def all_reduce(..., group=group.WORLD)``, a default evaluated
    when the module is imported. DTensor's redistribute imports it lazily, after the default group
    exists, so ten functions held that group for the life of the process and its gloo threads (one
    transport loop, two workers) outlived destroy into interpreter finalization (issue 48). None is
    what the defaults are when the module is imported before any group: the default group."""
    import sys

    mod = sys.modules.get("torch.distributed.nn.functional")
    if mod is None:
        return 0
    from torch.distributed import ProcessGroup

    n = 0
    for fn in vars(mod).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(type(d) is ProcessGroup for d in defaults):
            fn.__defaults__ = tuple(None if type(d) is ProcessGroup else d for d in defaults)
            n += 1
    return n


# ------------------------------------------------------------------ newer public APIs, with fallbacks
def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any = None,
                      _api: Optional[Callable[..., Any]] = None) -> None:
    """All-gather equal-sized tensors into one (``dist.all_gather_single``, new after 2.11; on
    older torch ``dist.all_gather_into_tensor``, the same collective under its old name)."""
    import torch.distributed as dist

    fn = _api if _api is not None else getattr(dist, "all_gather_single", None)
    (fn or dist.all_gather_into_tensor)(out, inp, group=group)


#: everything above that must exist on a supported torch; tests assert all are present
#: (``DTensor._local_tensor`` is an instance attribute: checked where a DTensor exists)
REQUIRED = {
    "DeviceMesh._flatten": lambda: importlib.import_module("torch.distributed.device_mesh").DeviceMesh._flatten,
    "torch._C._current_graph_task_id": lambda: torch._C._current_graph_task_id,
    "Tensor._is_view": lambda: torch.Tensor._is_view,
    "PipelineStage actions": lambda: [getattr(importlib.import_module(
        "torch.distributed.pipelining.stage")._PipelineStageBase, n) for n in STAGE_ACTIONS.values()],
    "fake_pg.FakeStore": lambda: importlib.import_module("torch.testing._internal.distributed.fake_pg").FakeStore,
    **{f"aten.{op}": (lambda op=op: getattr(torch.ops.aten, op)) for op in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")},
}


def check() -> list[str]:
    """Names of the required private APIs missing from this torch (empty when all are there)."""
    missing = []
    for module, name in PRIVATE_NAMES:
        try:
            private(module, name)
        except CompatError:
            missing.append(module if name is None else f"{module}.{name}")
    for name, probe in REQUIRED.items():
        try:
            if not probe():
                missing.append(name)
        except (AttributeError, ImportError, KeyError):
            missing.append(name)
    return missing
