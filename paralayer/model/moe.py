"""Mixture-of-experts feed-forward block (Mixtral / DeepSeek-V3 style).

    x (b, s, d) ──gate──> router scores ──top-k──> (expert, weight) per token-slot
      │                                                    │
      └── sort token-slots by expert, drop beyond capacity ┘
                 │
           experts (SwiGLU, stacked weights)   ← with expert parallel: all-to-all there and back
                 │
      weighted combine (index_add into the token rows)  (+ shared expert for every token)

Parameters (names matter: the lead's init builds every FULL tensor from (seed, name) and slices it):
    gate.weight  (E, d)               router, replicated (data parallel)
    w1           (E_local, ffn, d)    expert gate projection   ┐ expert-sharded along dim 0
    w3           (E_local, ffn, d)    expert up projection     │ (see ``local_slices``)
    w2           (E_local, d, ffn)    expert down projection   ┘
    b1, b3 (E_local, ffn), b2 (E_local, d)  GPT-OSS's expert biases (``expert_bias``), sharded as w
    shared.w{1,2,3}.weight            optional shared expert, replicated
Buffer:
    expert_bias  (E,)                 sigmoid router only: selection bias (aux-loss-free balancing),
                                      zeros at init, changed only by ``update_bias``.

Each forward sets
    self.aux_loss  scalar with grad: Switch load-balancing loss E·Σ_i f_i·P_i over this rank's tokens
    self.seq_aux_loss  scalar with grad (``seq_aux=True`` only, else None): DeepSeek-V3's
                   sequence-wise balance loss, the mean over this rank's sequences
                   (paralayer/model/routing.py; the runtime weighs it by ``seq_aux_loss_coef``)
    self.stats     {"tokens_per_expert": LongTensor(E), routed token-slots (before drops), summed
                    over the expert-parallel group; "dropped": int, token-slots dropped, summed over
                    the expert-parallel group}
and adds this rank's own numbers (no communication) to
    self.step_stats {"tokens_per_expert": LongTensor(E) | None, "dropped": int, "aux_loss_sum": float,
                    "forwards": int} — every forward since ``reset_step_stats()`` (the trainer resets
                    it each step and sums it over the data ranks; forwards re-run by activation
                    checkpointing during backward are not counted again).

Capacity (``capacity_factor`` not None) is applied per rank to that rank's own tokens, before any
dispatch: capacity = ceil(T·top_k·capacity_factor / E) with T = this rank's tokens (b·s). Within an
expert, token-slots are kept in token order (token t, then its k-th choice) and the rest dropped.
So expert parallelism never changes which tokens are dropped: the result of a rank depends only on
its tokens, exactly as with plain data parallelism.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paralayer.model import routing
from paralayer.model.recompute import recompute


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def swiglu(gate: Tensor, up: Tensor, recomputed: bool, act=_swiglu, cache=None) -> Tensor:
    """silu(gate) * up (or ``act``); ``recomputed``: only gate and up are kept for backward (the
    activation is made again there), one expert width per row fewer (resolve/memory_activations.py,
    the MoE term)."""
    return recompute(act, gate, up, cache=cache) if recomputed else act(gate, up)


class ClampedSwiGLU:
    """GPT-OSS's expert activation (transformers' GptOssExperts._apply_gate): gate clamped above at
    ``limit``, up to [−limit, limit], out = (up + 1) · gate · sigmoid(alpha · gate). Only gate and up
    are kept for backward (as SwiGLU's two inputs; autograd through the clamps would keep six)."""

    def __init__(self, limit: float, alpha: float):
        self.limit, self.alpha = float(limit), float(alpha)

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return _ClampedSwiGLUFn.apply(gate, up, self.limit, self.alpha)


class _ClampedSwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit, alpha):
        ctx.save_for_backward(gate, up)
        ctx.limit, ctx.alpha = limit, alpha
        g = gate.clamp(max=limit)
        return (up.clamp(min=-limit, max=limit) + 1) * (g * torch.sigmoid(g * alpha))

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        g = gate.clamp(max=limit)
        sig = torch.sigmoid(g * alpha)
        glu = g * sig
        # torch.clamp's gradient passes where the input lies within the bounds (ends included)
        d_gate = dout * (up.clamp(min=-limit, max=limit) + 1) * (sig + alpha * glu * (1 - sig)) * (gate <= limit)
        d_up = dout * glu * ((up >= -limit) & (up <= limit))
        return d_gate, d_up, None, None


class SharedExpert(nn.Module):
    """A plain SwiGLU feed-forward: w2 · (silu(w1 x) * (w3 x)); with ``gated`` (Qwen3-Next's
    shared_expert_gate, model.moe.shared_gate) times sigmoid(gate · x), one scalar per token."""

    def __init__(self, d_model: int, ffn_hidden: int, gated: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_hidden, bias=False)
        self.w3 = nn.Linear(d_model, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None
        self.recompute_act = False  # set with the routed experts' (MoEFeedForward.recompute_expert_act)
        self.fp8_cache = None  # set with the routed experts' (MoEFeedForward.fp8_cache)

    def forward(self, x: Tensor) -> Tensor:
        y = self.w2(swiglu(self.w1(x), self.w3(x), self.recompute_act, cache=self.fp8_cache))
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))


class MoEFeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_hidden: int, num_experts: int, top_k: int,
                 capacity_factor: float | None, router: str = "softmax", shared_ffn_hidden: int = 0,
                 spec: routing.RouterSpec | None = None, seq_aux: bool = False, router_bias: bool = False,
                 expert_bias: bool = False, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 shared_gate: bool = False):
        super().__init__()
        spec = spec or routing.RouterSpec(kind=router, top_k=top_k)
        if (spec.kind, spec.top_k) != (router, top_k):
            raise ValueError(f"spec {spec} disagrees with router={router!r}, top_k={top_k}")
        spec.check(num_experts)
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
        self.d_model = d_model
        self.ffn_hidden = ffn_hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = router
        self.spec = spec
        self.seq_aux = seq_aux

        self.gate = nn.Linear(d_model, num_experts, bias=router_bias)
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, ffn_hidden))
        # GPT-OSS: biases of each expert's gate, up and down projections (stacked as the weights),
        # and its clamped SwiGLU
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn_hidden)) if expert_bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, ffn_hidden)) if expert_bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model)) if expert_bias else None
        self.act_fn = _swiglu if swiglu_limit is None else ClampedSwiGLU(swiglu_limit, swiglu_alpha)
        self.shared = SharedExpert(d_model, shared_ffn_hidden, shared_gate) if shared_ffn_hidden > 0 else None
        # recompute=swiglu (runtime/build.py apply_recompute): each expert's silu(gate)·up, and the
        # shared expert's, recomputed in backward (selective leaves the experts alone, as planned)
        self._recompute_expert_act = False
        #: train.fp8.cache_activations (model/float8.py Fp8Tiles): the recomputed SwiGLU's inputs kept in
        #: FP8, here and in the shared expert (runtime/build.py apply_recompute sets both)
        self.fp8_cache = None
        if router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            # routed token-slots per expert since the last update_bias (this rank's tokens only)
            self.register_buffer("expert_load", torch.zeros(num_experts), persistent=False)

        # expert parallel (set by paralayer.parallel.expert.apply_expert_parallel, which also installs
        # ep_dispatch(module, xs, counts) -> ys, the all-to-all path: the model never imports parallel/)
        self.ep_dispatch = None
        self.ep_group = None
        # parallel/expert_node.py's two-stage dispatch: (module, x, tokens, weights, counts) -> the
        # combined output; it applies the weights itself (summed inside each node, then sent back)
        self.ep_node_dispatch = None
        # The rehearsal (paralayer/rehearse/rank.py) runs on fake tensors: routing decisions
        # are data it cannot see, so it routes every expert an equal share of the token-slots.
        self.even_routing = False
        self.ep_size = 1
        self.ep_rank = 0
        #: consecutive ep ranks that are the cp ranks of one micro-batch (runtime/build.py: parallel.cp
        #: where ep is a multiple of it): an FP8 expert GEMM runs once over their rows together
        self.ep_cp = 1
        self.num_local_experts = num_experts
        self.expert_offset = 0
        self.local_slices = self._make_local_slices()

        # Under autocast: None casts each expert's weights per forward (a microbatch's copy lives
        # until its backward, so pp holds one per microbatch in flight); a dict (the runtime sets
        # one for the span of its autocast region, :func:`shared_weight_casts`) shares one bf16
        # copy of the experts between the microbatches, as autocast's own cache does for
        # nn.Linear weights (it cannot here: ``w1[e]`` is a view, which autocast never caches).
        self.weight_cache: dict | None = None
        # train.precision=fp8: (rows, w) -> rows @ w.t() with FP8 casts (model/float8.py); None = plain
        self.expert_mm = None

        self.aux_loss: Tensor | None = None
        self.seq_aux_loss: Tensor | None = None
        self.stats: dict = {}
        # False while a forward must not count (a pipeline stage's shape inference runs one on
        # uninitialised tensors before the first real microbatch; the trainer toggles this)
        self.count_stats = True
        self.reset_step_stats()
        self.reset_parameters()

    @property
    def recompute_expert_act(self) -> bool:
        return self._recompute_expert_act

    @recompute_expert_act.setter
    def recompute_expert_act(self, on: bool) -> None:
        self._recompute_expert_act = bool(on)
        if self.shared is not None:
            self.shared.recompute_act = bool(on)

    def _make_local_slices(self) -> dict[str, tuple[int, int, int]]:
        """{param name: (dim, offset, full size)}: along ``dim`` this rank holds rows
        [offset, offset + local size) of a full dimension of ``full size``."""
        return {name: (0, self.expert_offset, self.num_experts) for name in ("w1", "w2", "w3", "b1", "b2", "b3")
                if getattr(self, name) is not None}

    def reset_parameters(self) -> None:
        """A standalone default (nn.Linear's), per expert. The lead's layout-independent init
        replaces this; it is only here so the module works on its own."""
        if self.w1.device.type == "meta":
            return
        with torch.no_grad():
            b_in, b_out = 1 / math.sqrt(self.d_model), 1 / math.sqrt(self.ffn_hidden)
            self.w1.uniform_(-b_in, b_in)
            self.w3.uniform_(-b_in, b_in)
            self.w2.uniform_(-b_out, b_out)
            for b in (self.b1, self.b2, self.b3):
                if b is not None:
                    b.zero_()

    # ---------------------------------------------------------------- routing
    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (T, d) → (expert ids (T, k) long, weights (T, k) fp32, router probs (T, E) fp32);
        the routers are in paralayer/model/routing.py."""
        bias = self.expert_bias if self.router == "sigmoid" else None
        return routing.route(self.gate(x).float(), self.spec, bias)

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.top_k * self.capacity_factor / self.num_experts)

    # ---------------------------------------------------------------- experts
    def experts_forward(self, xs: Tensor, counts: list[int], sources: list[list[int]] | None = None) -> Tensor:
        """Run the LOCAL experts on rows grouped by local expert: rows [sum(counts[:e]),
        sum(counts[:e+1])) go to local expert e. Returns (N, d) in the same row order.
        ``sources`` (expert parallel): sources[e] = the rows of expert e from each ep rank, in order.
        An FP8 expert GEMM (``expert_mm``) then runs once per micro-batch (per source, or per
        ``ep_cp`` consecutive sources: the cp ranks of one), so that its scales that span tokens
        cover one micro-batch, as one process's would (model/float8.py)."""
        outs = []
        w1, w2, w3 = self._compute_weights(xs)
        mm = self.expert_mm or _plain_mm
        b1, b2, b3 = self.b1, self.b2, self.b3
        # FP8 under cp (ep=1): every expert's casts reduce their amax over the cp ranks, so every
        # cp rank runs every expert, with rows or without (model/float8.py ExpertMatmul)
        paired = getattr(self.expert_mm, "token_mesh", None) is not None
        for e, rows in enumerate(xs.split(counts)):
            if rows.shape[0] == 0 and not paired:
                continue
            if self.expert_mm is not None and sources is not None:
                mm = _per_source(self.expert_mm, _by_batch(sources[e], self.ep_cp))
            gate, up = mm(rows, w1[e]), mm(rows, w3[e])
            if b1 is not None:
                gate, up = gate + b1[e], up + b3[e]
            h = swiglu(gate, up, self._recompute_expert_act, self.act_fn, self.fp8_cache)
            outs.append(mm(h, w2[e]) if b2 is None else mm(h, w2[e]) + b2[e])
        if not outs:
            # No rows. Keep the (empty) output connected to xs and to the weights: under expert
            # parallel, xs comes out of an all-to-all whose backward is a collective, and every rank
            # must run it (else the others hang); the weights then get zero grads instead of None.
            touch = xs.sum() + sum(getattr(self, n).sum() for n in self.local_slices)
            return xs.new_zeros(0, self.d_model) + 0 * touch
        return torch.cat(outs)

    def _compute_weights(self, xs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(w1, w2, w3) as the GEMMs on ``xs`` take them: the parameters, or, where autocast casts
        them (the rows on the weights' device) and a ``weight_cache`` is set, their casts, made
        once and shared (same values: a slice of the cast is the cast of the slice; the gradient
        still reaches the fp32 weights through the cast). A cast made before an in-place update of
        a weight is never reused (version check). Shape inference on meta rows is left alone."""
        ws = (self.w1, self.w2, self.w3)
        cache, dev = self.weight_cache, self.w1.device.type
        if cache is None or xs.device.type != dev or not torch.is_autocast_enabled(dev) \
                or not torch.is_grad_enabled():
            return ws
        dtype = torch.get_autocast_dtype(dev)
        if self.w1.dtype == dtype:
            return ws
        versions = tuple(w._version for w in ws)
        hit = cache.get(dtype)
        if hit is None or hit[0] != versions:
            hit = cache[dtype] = (versions, tuple(w.to(dtype) for w in ws))
        return hit[1]

    # ---------------------------------------------------------------- forward
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        T, k, E = x.shape[0], self.top_k, self.num_experts

        experts, weights, probs = self.route(x)

        # token-slots in token order: slot s = t*k + j is token t's j-th choice
        slot_expert = experts.reshape(-1)
        slot_weight = weights.reshape(-1)
        slot_token = torch.arange(T, device=x.device).repeat_interleave(k)
        if self.even_routing:
            return self._forward_even(x, shape, weights, probs, slot_token)
        routed = torch.bincount(slot_expert, minlength=E)              # (E,) before drops

        # aux loss (this rank's tokens): E · Σ_i f_i · P_i; f has no gradient, P does
        f = routed.float() / (T * k)
        self.aux_loss = E * (f * probs.mean(dim=0)).sum()
        self.seq_aux_loss = routing.sequence_loss(experts, probs, shape[0]) if self.seq_aux else None

        # sort slots by expert (stable → token order inside an expert), then apply capacity
        order = torch.argsort(slot_expert, stable=True)
        counts = routed
        cap = self.capacity(T)
        if cap is not None:
            starts = routed.cumsum(0) - routed
            position = torch.arange(order.numel(), device=x.device) - starts[slot_expert[order]]
            order = order[position < cap]
            counts = routed.clamp(max=cap)
        dropped = T * k - order.numel()

        tokens = slot_token[order]
        if getattr(self, "ep_node_dispatch", None) is not None:
            out = self.ep_node_dispatch(self, x, tokens, slot_weight[order], counts)
        else:
            xs = x.index_select(0, tokens)
            ys = self.experts_forward(xs, counts.tolist()) if self.ep_dispatch is None else \
                self.ep_dispatch(self, xs, counts)
            out = _combine(x, tokens, ys, slot_weight[order])
        if self.shared is not None:
            out = out + self.shared(x)

        self._record_stats(routed, dropped)
        return out.reshape(shape)

    def _forward_even(self, x: Tensor, shape, weights: Tensor, probs: Tensor, slot_token: Tensor) -> Tensor:
        """The forward with the token-slots spread evenly over the experts (sizes known without
        data; the rehearsal's router): expert e gets slots e, e+E, e+2E, ... up to its capacity."""
        T, k, E = x.shape[0], self.top_k, self.num_experts
        counts = [(T * k) // E + (1 if e < (T * k) % E else 0) for e in range(E)]
        cap = self.capacity(T)
        if cap is not None:
            counts = [min(c, cap) for c in counts]
        routed = torch.tensor(counts, dtype=torch.long, device=x.device)
        self.aux_loss = E * ((routed.float() / (T * k)) * probs.mean(dim=0)).sum()
        self.seq_aux_loss = (E * (routed.float() / (T * k)) * probs.mean(dim=0)).sum() if self.seq_aux else None
        order = torch.cat([torch.arange(e, e + E * c, E, device=x.device) for e, c in enumerate(counts) if c]) \
            if any(counts) else torch.zeros(0, dtype=torch.long, device=x.device)
        tokens = slot_token[order]
        slot_weight = weights.reshape(-1)
        if getattr(self, "ep_node_dispatch", None) is not None:
            out = self.ep_node_dispatch(self, x, tokens, slot_weight[order], counts)
        else:
            xs = x.index_select(0, tokens)
            ys = self.experts_forward(xs, counts) if self.ep_dispatch is None else self.ep_dispatch(self, xs, counts)
            out = _combine(x, tokens, ys, slot_weight[order])
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    # ---------------------------------------------------------------- stats, balancing
    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the sigmoid router's selection bias and load counter: a model built on the meta
        device and materialised with ``to_empty`` holds uninitialised memory there."""
        if self.router == "sigmoid":
            self.expert_bias.zero_()
            self.expert_load.zero_()

    def reset_step_stats(self) -> None:
        """Start a new optimizer step's accumulation (see ``step_stats``)."""
        self.step_stats: dict = {"tokens_per_expert": None, "dropped": 0, "aux_loss_sum": 0.0, "forwards": 0}

    @staticmethod
    def _in_backward() -> bool:
        # a forward re-run by activation checkpointing (recompute=full) inside backward: its tokens
        # were already counted by the first forward
        from paralayer.compat import in_backward

        return in_backward()

    @torch.no_grad()
    def _record_stats(self, routed: Tensor, dropped: int) -> None:
        if self._in_backward() or not self.count_stats:
            return
        if self.router == "sigmoid":
            self.expert_load += routed.to(self.expert_load.dtype)
        # this rank's own tokens, accumulated over the step's microbatches (no communication: the
        # trainer sums them over the data ranks once per step)
        st = self.step_stats
        st["tokens_per_expert"] = routed.detach().clone() if st["tokens_per_expert"] is None \
            else st["tokens_per_expert"] + routed
        st["dropped"] += int(dropped)
        st["aux_loss_sum"] += float(self.aux_loss.detach()) if self.aux_loss is not None else 0.0
        st["forwards"] += 1
        totals = torch.cat([routed, routed.new_tensor([dropped])])
        if self.ep_group is not None:
            import torch.distributed as dist
            dist.all_reduce(totals, group=self.ep_group)
        self.stats = {"tokens_per_expert": totals[:-1].clone(), "dropped": int(totals[-1])}

    @torch.no_grad()
    def update_bias(self, rate: float, group=None) -> None:
        """Aux-loss-free balancing (DeepSeek-V3), sigmoid router only: call once per optimizer step.
        bias_i += rate · sign(mean load − load_i), load = routed token-slots since the last call.

        ``group``: pass the whole data-parallel group (every rank holding a replica of this router,
        i.e. dp·cp including ep) so all replicas see the same load and keep the same bias.
        """
        if self.router != "sigmoid":
            raise RuntimeError("update_bias is only for router='sigmoid'")
        load = self.expert_load.clone()
        if group is not None:
            import torch.distributed as dist
            dist.all_reduce(load, group=group)
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()

    def __getstate__(self):
        # aux_loss is a graph node from the last forward: not copyable/picklable, and not state
        state = dict(super().__getstate__())
        state["aux_loss"] = None
        state["seq_aux_loss"] = None
        return state

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, ffn_hidden={self.ffn_hidden}, experts={self.num_experts} "
                f"(local {self.num_local_experts} from {self.expert_offset}), top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, router={self.router}, n_group={self.spec.n_group}, "
                f"topk_group={self.spec.topk_group}, scaling={self.spec.routed_scaling_factor}")


def _per_source(mm, splits: list[int]):
    """``mm`` run on each source's rows apart (one call when a single source sent rows)."""
    if len(splits) <= 1:
        return mm
    return lambda rows, w: torch.cat([mm(part, w) for part in rows.split(splits)])


def _by_batch(counts: list[int], peers: int) -> list[int]:
    """Rows per micro-batch: each ``peers`` consecutive senders' counts summed (the cp ranks of one
    micro-batch send as neighbours: parallel/mesh.py), the empty ones left out."""
    sums = [sum(counts[i:i + peers]) for i in range(0, len(counts), peers)]
    return [c for c in sums if c]


def _plain_mm(rows: Tensor, w: Tensor) -> Tensor:
    return rows @ w.t()


def _combine(x: Tensor, tokens: Tensor, ys: Tensor, weights: Tensor) -> Tensor:
    """Σ over a token's expert rows of weight · row, in ``x``'s dtype and shape (rows, d). The sum
    is taken in the rows' dtype: under autocast they are bf16 (the GEMMs') and the stream fp32, and
    index_add takes one dtype (autocast does not promote it); Megatron's unpermute sums in the
    rows' dtype too, and the rows saved for backward stay bf16."""
    out = torch.zeros(x.shape, dtype=ys.dtype, device=x.device)
    out = out.index_add(0, tokens, ys * weights.to(ys.dtype).unsqueeze(1))
    return out if out.dtype == x.dtype else out.to(x.dtype)


@contextlib.contextmanager
def shared_weight_casts(roots: Iterable[nn.Module]) -> Iterator[None]:
    """One autocast copy of each MoE block's experts for the span of this context, shared by every
    microbatch in it, freed when it closes. The runtime opens it with ``torch.autocast`` (the
    whole step under pp), so the experts are held as autocast's cache holds the other weights."""
    moes = [m for root in roots for m in root.modules() if isinstance(m, MoEFeedForward)]
    for m in moes:
        m.weight_cache = {}
    try:
        yield
    finally:
        for m in moes:
            m.weight_cache = None
