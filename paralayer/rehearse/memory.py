"""What one rehearsed rank holds: weights, gradients, optimizer states, and the activation peak.

Why these counters: under ``FakeTensorMode`` no byte is allocated, but every tensor still has its
shape and dtype, so the bytes a real device would hold are exact. Parameters, gradients and the
optimizer's states are counted from the tensors themselves after the step (the local shard of a
DTensor); the activation peak is the peak of the bytes autograd keeps for backward
(``saved_tensors_hooks``, one count per storage), the same quantity the plan's activation model
was fitted to (``paralayer/runtime/activation_memory.py``), keyed by storage identity because
fake storages have no address. Under autocast a saved tensor that is a cast copy of a weight
(``weight_copy_of``: the bf16 copy a GEMM keeps for its backward) is counted apart, and its live
peak reported with the weights, as the plan counts autocast's copies
(``memory.autocast_copy_params``: one per weight that backward keeps in bf16).

Recomputation (``paralayer.model.recompute``: full recompute, and selective's attention core and
SwiGLU product) keeps what its forward saves behind its own saved-tensor hooks, so the hooks above
see only the region's inputs; the recomputation reports what it makes and when each piece is freed
(``recompute.observe``), and ``SavedPeak`` counts those bytes live in between (storages live
already, as the region's input, count once): the peak as a live-bytes tracker would see it
(torch's ``MemTracker`` itself refuses a root module called again within one step, as each
microbatch calls it). Autocast's weight copies made again there count with the weights, as above.
Not measured: a weight cast that a cache holds while no saved tensor does: under pp with
recompute=full, autocast's cache (one region per step) keeps the bf16 copy of a recomputed layer's
GEMM weights without SP, and the experts' shared copy (model/moe.py), for the whole step; the plan
does not count them either (resolve/memory/autocast.py ``autocast_copy_terms``).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from paralayer.model import recompute as recompute_mod


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bytes(ts: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    n = 0
    for t in ts:
        t = _local(t)
        if id(t) in seen:
            continue
        seen.add(id(t))
        n += int(t.numel()) * t.element_size()
    return n


def param_bytes(params: list, gathered_through_step: bool = False, gather_dtype: "torch.dtype | None" = None) -> int:
    """This rank's weights: the local shard of each parameter. ``gathered_through_step`` (ZeRO-2:
    FSDP keeps each unit's gathered weights from its forward to its backward) adds, for each
    parameter FSDP shards over the data-parallel ranks (dp_cp, or edp for experts, a one-rank group
    included), the gathered copy FSDP2 holds beside the shard: its data-parallel shards whole, in
    ``gather_dtype`` (the MixedPrecisionPolicy's param_dtype: bf16 under bf16-fsdp) or the
    parameter's own. FSDP2 keeps both (its ``_sharded_param_data`` and ``_unsharded_param`` are
    separate storages, fp32 and bf16 alike, checked with torch 2.13 on gloo)."""
    n = _bytes(params)
    if not gathered_through_step:
        return n
    for p in params:
        t = _local(p)
        k, fsdp = 1, False
        mesh = getattr(p, "device_mesh", None)
        for dim, pl in enumerate(getattr(p, "placements", ())):
            names = mesh.mesh_dim_names or ()
            # Shard, or FSDP's _StridedShard over tp's (which is_shard() does not count)
            if not (pl.is_replicate() or pl.is_partial()) and dim < len(names) and names[dim] in ("dp_cp", "edp"):
                k *= mesh.size(dim)
                fsdp = True
        if fsdp:
            size = torch.empty((), dtype=gather_dtype).element_size() if gather_dtype is not None else t.element_size()
            if _fp8_gathered(t):
                size = 1  # FSDP's FP8 all-gather (model/float8.py): the gathered copy is FP8
            n += int(t.numel()) * k * size
    return n


def _fp8_gathered(t: torch.Tensor) -> bool:
    """Whether FSDP all-gathers this shard in FP8: torchao's weight wrapper under
    ``enable_fsdp_float8_all_gather`` (its fsdp_pre_all_gather casts the shard to FP8)."""
    return type(t).__name__ == "WeightWithDynamicFloat8CastTensor"


def grad_bytes(params: list) -> int:
    """This rank's gradients after the step's backward (and the reducer)."""
    return _bytes(p.grad for p in params if p.grad is not None)


def optimizer_bytes(opt: Any) -> int:
    """Every state tensor the optimizer keeps (AdamW: exp_avg, exp_avg_sq; the 0-d step counter is
    not memory anyone plans for)."""
    inner = getattr(opt, "inner", opt)
    out = []
    for st in inner.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return _bytes(out)


def qk_clip_bytes(clip: Any) -> int:
    """QK-clip's running max logits (one fp32 per local head per attention module it watches;
    optim/qk_clip.py), 0 without it: held through the step, beside the optimizer's states."""
    return 0 if clip is None else _bytes(m.max_logit.value for m in clip.modules)


#: Single-input autograd nodes a weight passes through on its way to a GEMM: autocast's cast,
#: views, transposes, DTensor's local-tensor unwrap.
_WEIGHT_PATH = ("ToCopyBackward", "TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward",
                "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward", "AliasBackward", "ToLocalBackward",
                "FromLocalBackward", "CloneBackward", "SelectBackward", "SliceBackward", "UnbindBackward")


def weight_copy_of(t: torch.Tensor):
    """The Parameter ``t`` is a cast copy of (autocast's bf16 copy of an fp32 weight, possibly
    viewed or transposed for the GEMM), else None: walks ``t``'s grad_fn through single-input
    casts and views to a Parameter's AccumulateGrad. A cast, not the weight itself (that is
    excluded before)."""
    fn, cast = t.grad_fn, False
    for _ in range(8):
        if fn is None:
            return None
        name = type(fn).__name__
        if name == "AccumulateGrad":
            # a Parameter only: a pipeline stage's received input is a leaf too, and under
            # autocast its cast back to fp32 (parallel/pipeline/stage_hooks.py boundary_hooks) is an activation
            return fn.variable if cast and isinstance(fn.variable, torch.nn.Parameter) else None
        if not name.startswith(_WEIGHT_PATH):
            return None
        cast = cast or name.startswith("ToCopyBackward")
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return None
        fn = nxt[0]
    return None


def _key(t: torch.Tensor) -> int:
    return _storage(t)[0]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(storage key, bytes) of what a saved tensor holds. A float8 tensor of torchao
    (Float8TrainingTensor: FP8 ``_data`` and an fp32 ``_scale``, a wrapper whose own storage is
    sized by its original dtype) holds its data and its scale: keyed by the data's storage, sized
    by both (the wrapper's own size read an FP8 input saved under tp at 4 bytes an element)."""
    base = _local(t)
    data, scale = getattr(base, "_data", None), getattr(base, "_scale", None)
    if isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor):
        st = data.untyped_storage()
        return st._cdata, st.nbytes() + scale.untyped_storage().nbytes()
    st = base.untyped_storage()
    return st._cdata, st.nbytes()


class SavedPeak:
    """Live bytes of tensors saved for backward and their peak, for fake tensors too.

    ``exclude`` (parameters, the step's tokens) are not activations; a storage saved several times
    counts once; bytes leave when autograd drops the saved tensor."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.skip = {_key(t) for t in exclude}
        self.live = 0
        self.peak_bytes = 0
        self.refs: dict[int, int] = {}
        self._ctx = None
        #: autocast's cast copies of the weights saved for backward: their live bytes and peak,
        #: apart from the activations' (the plan counts them with the weights, memory.autocast_copy_params)
        self.copies_live = 0
        self.weight_copy_bytes = 0
        self.copies_per_weight: dict[int, int] = {}
        self.copy_keys: set[int] = set()
        #: what recomputations made and still hold (paralayer.model.recompute), and its peak
        self.recompute_live = 0
        self.recompute_bytes = 0
        self.recomputed_refs: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            # a weight (FSDP2's gathered weights are Parameters too, freed by resharding, not by
            # autograd): not an activation
            return t
        try:
            key, nbytes = _storage(t)
        except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested)
            return t
        if key in self.skip or nbytes == 0:
            return t
        w = weight_copy_of(t) if t.grad_fn is not None else None
        n = self.refs.get(key, 0)
        if n == 0 and w is not None:
            self.copies_live += nbytes
            self.weight_copy_bytes = max(self.weight_copy_bytes, self.copies_live)
            self.copies_per_weight[id(w)] = self.copies_per_weight.get(id(w), 0) + 1
            nbytes = -nbytes  # negative: a weight copy's bytes (see release)
        elif n == 0:
            self.live += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live)
        elif key in self.copy_keys:
            nbytes = -nbytes
        if nbytes < 0:
            self.copy_keys.add(key)
        self.refs[key] = n + 1
        return _Held(t.detach(), key, nbytes, self)

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def release(self, key: int, nbytes: int) -> None:
        n = self.refs.get(key, 0) - 1
        if n <= 0:
            self.refs.pop(key, None)
            if nbytes < 0:
                self.copies_live += nbytes
                self.copy_keys.discard(key)
            else:
                self.live -= nbytes
        else:
            self.refs[key] = n

    def recomputed(self, saved: list) -> list:
        """A recomputation made ``saved`` (``paralayer.model.recompute``): each joins the live bytes
        until the recompute frame reports it freed (``released``); weights and storages live
        already are not counted again, autocast's weight copies count with the weights."""
        tokens = []
        for t in saved:
            if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
                tokens.append(None)
                continue
            try:
                key, nbytes = _storage(t)
            except Exception:  # noqa: BLE001 - a tensor without storage
                tokens.append(None)
                continue
            if key in self.skip or key in self.refs or nbytes == 0:
                tokens.append(None)
                continue
            copy = t.grad_fn is not None and weight_copy_of(t) is not None
            n = self.recomputed_refs.get(key, 0)
            if n == 0 and copy:
                self.copies_live += nbytes
                self.weight_copy_bytes = max(self.weight_copy_bytes, self.copies_live)
            elif n == 0:
                self.live += nbytes
                self.recompute_live += nbytes
                self.recompute_bytes = max(self.recompute_bytes, self.recompute_live)
                self.peak_bytes = max(self.peak_bytes, self.live)
            self.recomputed_refs[key] = n + 1
            tokens.append((key, -nbytes if copy else nbytes))
        return tokens

    def released(self, token: tuple) -> None:
        key, nbytes = token
        n = self.recomputed_refs.get(key, 0) - 1
        if n > 0:
            self.recomputed_refs[key] = n
            return
        self.recomputed_refs.pop(key, None)
        if nbytes < 0:
            self.copies_live += nbytes
        else:
            self.live -= nbytes
            self.recompute_live -= nbytes

    def __enter__(self) -> "SavedPeak":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        self._observing = recompute_mod.observe(self)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._observing.__exit__(*exc)
        self._ctx.__exit__(*exc)
        return False


class _Held:
    __slots__ = ("t", "key", "nbytes", "owner")

    def __init__(self, t, key, nbytes, owner):
        self.t, self.key, self.nbytes, self.owner = t, key, nbytes, owner

    def __del__(self):
        try:
            self.owner.release(self.key, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
