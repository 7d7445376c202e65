"""Activation recomputation that reruns a region once per forward, however many backward passes read it.

Why not ``torch.utils.checkpoint`` as is: its non-reentrant recomputation belongs to the backward's
graph task. The zero-bubble schedules (zbv, dualpipev) split a microbatch's backward into an input
pass and one weight pass per parameter group (``torch.distributed.pipelining._backward``), each a
graph task of its own, so torch reran a checkpointed layer in each of them: on tiny-moe pp2
dualpipev with full recompute, 2.9 forwards per layer and microbatch on the first pp rank and 4.0
on the last, where one forward and one recomputation are two (pytorch/pytorch#136766 is the same
interaction). FLOPs, the MoE all-to-all and the activation peak then exceeded the plan.

Here the recomputed tensors belong to the forward's frame, not to a graph task: the first read in
a backward pass reruns the region, and later reads take the same tensors (a weight pass's parameter
groups share one rerun). Each is dropped when the autograd node that saved it lets it go, so a full
backward frees them layer by layer as torch's does; a split backward's input pass drops its rerun
when it ends (:func:`dropped_after`), and the weight pass reruns once more. The inputs are saved
by an autograd node outside the region (as torch's ``_NoopSaveInputs``), so saved-tensor hooks
around the step (the rehearsal's counter, ``paralayer/rehearse/memory.py``) see them; :func:`observe` lets such a counter also see what a
recomputation makes and when it is freed.

:func:`rebuilt` goes one step further for a region whose *outputs* a later op saves (DeepSeek-V3's
recompute of every RMSNorm and of MLA's up-projections, arXiv 2412.19437 §3.2.3: "thereby
eliminating the need to persistently store their output activations"): under the context it
returns, an op that saves one of the region's outputs (or a view of one) keeps a handle, and the
first read reruns the region, which makes its own saved tensors and its outputs again (one rerun
for both). Saves of anything else pass to the hooks that were active outside (the rehearsal's counter).

The regions we recompute (a block, the attention core, the SwiGLU product, the norms, MLA's
up-projections) hold no random op, so
the RNG state is not replayed; autocast's state is. Inside ``torch.compile`` (selective recompute
traced in a compiled block) torch's own checkpoint is used: the compiler turns it into its graph's
recomputation.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

_observer: list = [None]  # the rehearsal's counter while :func:`observe` is active (instrumentation only)
_dropping: list = [None]  # the frames rerun inside :func:`dropped_after`, while it is active


@contextlib.contextmanager
def observe(observer: Any) -> Iterator[None]:
    """While active, every recomputation calls ``observer.recomputed(tensors) -> tokens`` with the
    tensors it made (before they are detached: their autograd history is still readable) and
    ``observer.released(token)`` as each is freed."""
    prev = _observer[0]
    _observer[0] = observer
    try:
        yield
    finally:
        _observer[0] = prev


@contextlib.contextmanager
def dropped_after() -> Iterator[None]:
    """Frames rerun inside drop what they made at the end (the next read reruns them). The
    pipeline wraps a split backward's input pass in it (``parallel/pipeline/split_backward.py``): torch's
    zero-bubble orders run some weight passes long after their input pass (DualPipeV's last rank
    holds p of them at once), and keeping a whole chunk's recomputed set through that gap cost
    263 GiB on DeepSeek-V3's last pp rank; rerun once more in the weight pass it costs one
    forward of those chunk-microbatches (``resolve/memory/states.py: input_pass_reruns``)."""
    prev = _dropping[0]
    frames: list = []
    _dropping[0] = frames
    try:
        yield
    finally:
        _dropping[0] = prev
        for f in frames:
            f.drop()


class _SaveInputs(torch.autograd.Function):
    """Saves the region's tensor inputs through autograd's saved-tensor machinery (so hooks around
    the step see them) and returns an empty tensor; never part of a backward."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - the output reaches no loss
        raise RuntimeError("recompute: the inputs' saver has no backward")


def _autocast_state() -> list[tuple[str, bool, torch.dtype, bool]]:
    out = []
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled()))
    return out


class _Holder:
    """What autograd keeps for one saved tensor of the region: its index in the forward's order."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: "_Frame", index: int):
        self.frame, self.index = frame, index

    def __del__(self):
        try:
            self.frame.release(self.index)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class _Frame:
    """One forward of one region: how to rerun it, and what its rerun made while anyone needs it."""

    def __init__(self, fn: Callable, args: tuple, cache: Any = None):
        self.fn = fn
        #: how the inputs are stored (None: as they are; model/float8.py Fp8Tiles: in FP8), and
        #: each tensor input's (dtype, requires_grad) to read them back as
        self.cache = cache
        self.meta = [(a.dtype, a.requires_grad) for a in args if isinstance(a, torch.Tensor)]
        self.slots = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.autocast = _autocast_state()
        self.saver: Optional[torch.Tensor] = None
        self.count = 0                    # tensors the forward saved
        self.alive: set[int] = set()      # of those, the ones autograd still holds
        self.store: Optional[dict] = None  # index -> (recomputed tensor, observer token)
        #: :func:`rebuilt`: each output's storage -> its index; the handles alive per storage; the
        #: rerun's outputs (index -> (tensor, observer token)) while a handle needs them
        self.out_keys: dict[int, int] = {}
        self.out_dtypes: dict[int, torch.dtype] = {}
        self.out_alive: dict[int, int] = {}
        self.out_store: dict[int, tuple] = {}

    def pack(self, t: torch.Tensor) -> _Holder:
        i = self.count
        self.count += 1
        self.alive.add(i)
        return _Holder(self, i)

    def unpack(self, h: _Holder) -> torch.Tensor:
        if self.store is None:
            self._rerun()
        try:
            return self.store[h.index][0]
        except KeyError:
            raise RuntimeError(f"recompute: saved tensor {h.index} of {self.count} was not made again by the "
                               "recomputation (the region is not deterministic)") from None

    def release(self, i: int) -> None:
        self.alive.discard(i)
        if self.store is not None and i in self.store:
            _, token = self.store.pop(i)
            obs = _observer[0]
            if obs is not None and token is not None:
                obs.released(token)
        if not self.alive and not self.out_alive:
            self.saver = None  # the inputs go with the last saved tensor

    def output(self, h: "_OutHolder") -> torch.Tensor:
        """The rerun's output that ``h`` saved, laid out as the saved tensor was (a view of it)."""
        if self.store is None:
            self._rerun()
        base = self.out_store[h.index][0]
        return base.as_strided(h.size, h.stride, h.offset)

    def release_out(self, key: int) -> None:
        n = self.out_alive.get(key, 0) - 1
        if n > 0:
            self.out_alive[key] = n
            return
        self.out_alive.pop(key, None)
        j = self.out_keys.get(key)
        if j in self.out_store:
            _, token = self.out_store.pop(j)
            obs = _observer[0]
            if obs is not None and token is not None:
                obs.released(token)
        if not self.alive and not self.out_alive:
            self.saver = None

    def drop(self) -> None:
        """Forget the rerun's tensors; a later read reruns the region."""
        store, self.store = self.store, None
        outs, self.out_store = self.out_store, {}
        obs = _observer[0]
        if obs is not None:
            for _, token in list((store or {}).values()) + list(outs.values()):
                if token is not None:
                    obs.released(token)

    def _inputs(self) -> list:
        args = list(self.slots)
        saved = self.saver.grad_fn.saved_tensors
        if self.cache is not None:  # (values, scales) per input
            saved = [self.cache.unpack(q, s, dt).requires_grad_(rg)
                     for q, s, (dt, rg) in zip(saved[0::2], saved[1::2], self.meta)]
        for i, t in zip(self.tensor_at, saved):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        return args

    def _rerun(self) -> None:
        made: dict[int, torch.Tensor] = {}
        k = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if k[0] in self.alive:
                made[k[0]] = t
            k[0] += 1
            return t

        args = self._inputs()
        with contextlib.ExitStack() as ctx:
            ctx.enter_context(torch.enable_grad())
            for dev, enabled, dtype, cache in self.autocast:
                ctx.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache))
            ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            res = self.fn(*args)
        if k[0] != self.count:
            raise RuntimeError(f"recompute: the recomputation saved {k[0]} tensors where the forward saved "
                               f"{self.count} (the region is not deterministic)")
        # the outputs a handle still reads (rebuilt): made again by the same rerun
        outs = {j: t for j, t in enumerate(_tensors(res)) if j in {self.out_keys[k_] for k_ in self.out_alive}}
        obs = _observer[0]
        order = sorted(made)
        tokens = (obs.recomputed([made[i] for i in order] + [outs[j] for j in sorted(outs)]) if obs is not None
                  else [None] * (len(order) + len(outs)))
        self.store = {i: (made[i].detach(), tok) for i, tok in zip(order, tokens)}
        self.out_store = {j: (outs[j].detach(), tok) for j, tok in zip(sorted(outs), tokens[len(order):])}
        if _dropping[0] is not None:
            _dropping[0].append(self)


def recompute(fn: Callable[..., Any], *args: Any, cache: Any = None) -> Any:
    """``fn(*args)``, keeping only its inputs for backward: the first backward pass that needs one
    of the region's saved tensors reruns ``fn`` and every later pass reuses that rerun. ``cache``
    (model/float8.py Fp8Tiles): the inputs are kept packed by it (FP8) and the rerun reads them
    unpacked (refused with train.compile, whose checkpoint keeps them as they are)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False)
    return _run(_Frame(fn, args, cache), fn, args)


def _run(frame: _Frame, fn: Callable, args: tuple) -> Any:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if frame.cache is not None:
        tensors = [x for t in tensors for x in frame.cache.pack(t)]
    dummy = torch.empty((0,), requires_grad=True)
    frame.saver = _SaveInputs.apply(dummy, *tensors)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args)


def _tensors(res: Any) -> list:
    """A region's tensor outputs in order (one tensor, or a tuple/list of them)."""
    if isinstance(res, torch.Tensor):
        return [res]
    return [t for t in res if isinstance(t, torch.Tensor)] if isinstance(res, (tuple, list)) else []


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return getattr(t, "_local_tensor", t).untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested)
        return None


class _OutHolder:
    """What a later op keeps for one of a :func:`rebuilt` region's outputs: which one, and the
    saved tensor's layout over its storage (a view of the output is rebuilt as the same view)."""

    __slots__ = ("frame", "key", "index", "size", "stride", "offset")

    def __init__(self, frame: _Frame, key: int, t: torch.Tensor):
        self.frame, self.key, self.index = frame, key, frame.out_keys[key]
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        frame.out_alive[key] = frame.out_alive.get(key, 0) + 1

    def __del__(self):
        try:
            self.frame.release_out(self.key)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def rebuilt(fn: Callable[..., Any], *args: Any) -> tuple[Any, contextlib.AbstractContextManager]:
    """``(fn(*args), consumers)``: ``fn`` runs as :func:`recompute` runs it (its own saved tensors
    are made again in backward), and inside ``consumers`` any op that saves one of its outputs (or a
    view of one) keeps a handle instead: the output is made again by the same rerun when read.
    So neither the region's saved tensors nor its outputs stay alive between forward and backward;
    only its inputs do. Outside autograd (no grad) the context does nothing. Outputs are known by
    their storage, so the caller keeps them referenced while ``consumers`` is open (a freed
    storage's address could come back for another tensor); model/block.py and
    model/latent_attention.py hold them in locals across it."""
    if not torch.is_grad_enabled():
        return fn(*args), contextlib.nullcontext()
    if torch.compiler.is_compiling():  # refused with train.compile (config/validate.py)
        raise RuntimeError("recompute: rebuilt regions are not traced by torch.compile")
    frame = _Frame(fn, args)
    res = _run(frame, fn, args)
    for j, t in enumerate(_tensors(res)):
        key = _storage_key(t)
        if key is not None and key not in frame.out_keys:
            frame.out_keys[key], frame.out_dtypes[key] = j, t.dtype
    return res, _consumers(frame)


@contextlib.contextmanager
def _consumers(frame: _Frame) -> Iterator[None]:
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is not None and key in frame.out_keys and t.dtype == frame.out_dtypes[key]:
            return _OutHolder(frame, key, t)
        return outer_pack(t) if outer_pack is not None else t

    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, _OutHolder):
            return x.frame.output(x)
        return outer_unpack(x) if outer_unpack is not None else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
