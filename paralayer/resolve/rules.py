"""Layout rules checked before anything starts (REFERENCE.md, "Rules"; Megatron-Core arguments.py,
torchtitan parallel_dims.py).

Why a separate pass: a bad layout should fail here, in well under a second, with EVERY problem
listed at once — not after minutes of rank start-up, one crash at a time, mid-forward. Each problem
is an :class:`Issue` naming the knob(s) a user actually sets and the nearest values that would work.

Torch-free and pure: :func:`check` takes a Config and returns a :class:`Layout` (resolved degrees,
schedule, world, microbatches) plus the errors and warnings, so the planner can call it in a loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from paralayer.config import Config
from paralayer.resolve.fp8 import check_fp8

#: Schedules that run two model chunks per pipeline rank in a V shape (chunk c on rank c, then back).
V_SCHEDULES = ("zbv", "dualpipev")


@dataclass
class Issue:
    """One problem: the field a user sets, and a message naming valid values."""

    field: str
    message: str

    def to_dict(self) -> dict:
        return {"field": self.field, "message": self.message}


@dataclass
class Layout:
    """The resolved layout every later step (memory, cost, runtime) reads; plain numbers only."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    world: int = 1
    nodes: int = 1
    devices_per_node: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    tp_overlap: bool = False
    pp_overlap: bool = False
    zero: int = 0
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch: int = 1
    microbatches: int = 1
    padded_vocab: int = 1
    device: str = "cpu"
    precision: str = "fp32"
    stage_layers: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return self.pp * self.vpp


# ------------------------------------------------------------------ helpers
def divisors(n: int) -> list[int]:
    n = max(int(n), 1)
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest(values: list[int], target: int, k: int = 4) -> list[int]:
    """The k values closest to target, in ascending order (what a user most likely meant)."""
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:k])


def _fmt(values) -> str:
    values = list(values)
    return ", ".join(map(str, values)) if values else "none"


def auto_device(device: str, peak_tflops: object = None) -> str:
    """THE rule for ``cluster.device: auto`` (the resolver, dispatch and the SLURM submitter all ask
    this): cuda when the profile names a GPU peak (``peak_tflops`` set), else cpu. Torch-free on
    purpose: a plan for a GPU cluster is made on a laptop; whether this machine has the devices is
    checked only when a run is launched here."""
    if device != "auto":
        return device
    return "cuda" if peak_tflops else "cpu"


def resolve_device(cfg: Config) -> str:
    return auto_device(cfg.cluster.device, cfg.cluster.peak_tflops)


def resolve_precision(cfg: Config, device: str) -> str:
    """The base precision the memory and time models count: fp8 runs its FP8 GEMMs inside a bf16
    run on GPUs and an fp32 one on CPU (emulated casts; paralayer/resolve/fp8.py)."""
    p = cfg.train.precision
    if p not in ("auto", "fp8"):
        return p
    if p == "fp8" and cfg.train.fp8.base_precision != "auto":
        return cfg.train.fp8.base_precision  # --rehearse: a GPU plan's bf16 on this CPU
    return "bf16" if device == "cuda" else "fp32"


def chunk_rank(chunk: int, pp: int, schedule: str) -> int:
    """Pipeline rank of model chunk ``chunk``: Megatron's interleaving (c % pp), or V shape."""
    if schedule in V_SCHEDULES:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def stage_layers(n_layers: int, chunk_sizes: list[int]) -> list[list[int]]:
    """Global layer indices of each chunk, in order."""
    out, start = [], 0
    for n in chunk_sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def valid_tp(cfg: Config, limit: int) -> list[int]:
    """tp values (≤ limit) every tp rule accepts for this model (vocab is padded, never a reason):
    the divisors of gcd(n_heads, n_kv_heads, ffn_hidden). Experts are not split by tp (ETP=1: the
    MoE block runs whole on every tp rank), so the expert width sets no tp rule."""
    m = cfg.model
    g = math.gcd(math.gcd(m.n_heads, m.n_kv_heads), m.ffn_hidden)
    return [d for d in divisors(g) if d <= limit]


def _multiples_near(target: int, step: int) -> list[int]:
    """The multiples of step just below and above target (positive)."""
    lo = (target // step) * step
    return [v for v in (lo, lo + step) if v > 0]


# ------------------------------------------------------------------ the rules
def check(cfg: Config) -> Layout:
    """Resolve the layout and collect every rule violation (never stops at the first).

    Each step reads the config and the layout resolved so far, sets its part of the layout and
    appends its Issues; the order matters only where a step needs an earlier one's result (dp
    before the batch rules, vpp before the pipeline split)."""
    p, t = cfg.parallel, cfg.train
    lay = Layout(tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, schedule=p.schedule, zero=p.zero,
                 recompute=p.recompute, recompute_every=getattr(p, "recompute_every", 1), micro_batch=t.micro_batch)
    lay.device = resolve_device(cfg)
    lay.precision = resolve_precision(cfg, lay.device)
    for step in (check_schedule, check_world, check_tensor_parallel, check_sequence_parallel, check_pipeline_split,
                 check_context_parallel, check_experts, check_overlap, check_model_parts, check_batch, check_eval,
                 _check_fp8):
        step(cfg, lay)
    return lay


def _check_fp8(cfg: Config, lay: Layout) -> None:
    check_fp8(cfg, lay, Issue)


def _error(lay: Layout, fld: str, msg: str) -> None:
    lay.errors.append(Issue(fld, msg))


def _warn(lay: Layout, fld: str, msg: str) -> None:
    lay.warnings.append(Issue(fld, msg))


def check_schedule(cfg: Config, lay: Layout) -> None:
    """The schedule fixes vpp: V schedules run exactly 2 chunks per rank, interleaved needs >= 2,
    the others 1; every pipeline schedule needs pp >= 2."""
    p = cfg.parallel
    sched, pp = p.schedule, p.pp
    if sched in V_SCHEDULES:
        if p.vpp == 1:
            lay.vpp = 2
            lay.notes.append(f"parallel.schedule={sched} runs exactly 2 chunks per pipeline rank: vpp set to 2")
        elif p.vpp != 2:
            _error(lay, "parallel.vpp", f"parallel.schedule={sched} runs exactly 2 model chunks per pipeline rank; "
                   f"parallel.vpp={p.vpp} is not valid (use vpp=2, or 1 to let it be set)")
            lay.vpp = 2
        if pp < 2:
            _error(lay, "parallel.pp", f"parallel.schedule={sched} is a pipeline schedule and needs parallel.pp >= 2 "
                   f"(got pp={pp}); use schedule=1f1b for pp=1")
    elif sched == "interleaved":
        if p.vpp < 2:
            _error(lay, "parallel.vpp", f"parallel.schedule=interleaved needs parallel.vpp >= 2 model chunks per rank "
                   f"(got vpp={p.vpp}); e.g. vpp=2, or schedule=1f1b")
        if pp < 2:
            _error(lay, "parallel.pp", f"parallel.schedule=interleaved needs parallel.pp >= 2 (got pp={pp})")
    elif p.vpp != 1:
        _error(lay, "parallel.vpp", f"parallel.vpp={p.vpp} (virtual pipeline chunks) needs "
               f"parallel.schedule=interleaved (or zbv/dualpipev with vpp=2); with schedule={sched} use vpp=1")


def check_world(cfg: Config, lay: Layout) -> None:
    """The world (from the profile, or on CPU the product of the degrees) and dp (auto: what is left)."""
    p, c = cfg.parallel, cfg.cluster
    tp, pp, cp = p.tp, p.pp, p.cp
    fixed = tp * pp * cp
    explicit_dp = p.dp if isinstance(p.dp, int) else None
    if c.devices_per_node is None:
        # cluster=local (DESIGN.md): the world is the product of the degrees, dp=auto counts as 1.
        dpn = fixed * (explicit_dp or 1)
        where = "the product of the degrees" + (f" × cluster.nodes={c.nodes}" if c.nodes > 1 else "")
    else:
        dpn = c.devices_per_node
        where = f"cluster.nodes={c.nodes} × cluster.devices_per_node={dpn}"
    world = dpn * c.nodes
    lay.nodes, lay.devices_per_node, lay.world = c.nodes, dpn, world
    if explicit_dp is None:
        lay.dp = max(world // fixed, 1)
        if world % fixed:
            need = fixed * dpn // math.gcd(fixed, dpn)
            _error(lay, "parallel.dp", f"dp=auto: tp·pp·cp = {tp}·{pp}·{cp} = {fixed} (parallel.tp·parallel.pp·"
                   f"parallel.cp) does not divide the world of {world} devices ({where}); use a world that is a "
                   f"multiple of {fixed} (e.g. cluster.nodes={max(need // dpn, 1)} for {max(need, fixed)} devices) "
                   f"or degrees whose product divides {world}")
        return
    lay.dp = explicit_dp
    if fixed * explicit_dp != world:
        hint = f"dp=auto gives dp={world // fixed}" if world % fixed == 0 else \
            f"tp·pp·cp={fixed} does not divide {world} either"
        _error(lay, "parallel.dp", f"world = tp·pp·cp·dp = {tp}·{pp}·{cp}·{explicit_dp} = {fixed * explicit_dp} "
               f"(parallel.tp·parallel.pp·parallel.cp·parallel.dp) but the cluster has {world} devices ({where}); "
               f"{hint}")


def dp_source(cfg: Config, lay: Layout) -> str:
    """Where dp came from, for messages about rules that involve it: the field a user typed may be
    the cluster's size rather than a degree."""
    c, p = cfg.cluster, cfg.parallel
    if isinstance(p.dp, int):
        return "parallel.dp"
    world = (f"cluster.nodes={c.nodes} × cluster.devices_per_node={c.devices_per_node}" if c.devices_per_node
             else "the product of the degrees" + (f" × cluster.nodes={c.nodes}" if c.nodes > 1 else ""))
    return f"parallel.dp=auto: {lay.world} devices ({world}) / parallel.tp·pp·cp"


def check_tensor_parallel(cfg: Config, lay: Layout) -> None:
    """Heads (RoPE needs an even head dim, GQA groups), KV heads and FFN width against tp; vocab padded."""
    m, tp, dpn = cfg.model, cfg.parallel.tp, lay.devices_per_node
    if cfg.cluster.devices_per_node is None:
        vt_msg = f"valid tp for this model: {_fmt(valid_tp(cfg, max(8, tp)))}"
    else:
        vt_msg = f"valid tp for this model within a node of {dpn}: {_fmt(valid_tp(cfg, dpn))}"
    if m.head_dim is not None or m.mla.kv_lora_rank > 0:
        pass  # the head width is model.head_dim or MLA's (config/model_checks.py checks them), not d_model/n_heads
    elif m.d_model % m.n_heads:
        _error(lay, "model.n_heads", f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}; valid "
               f"n_heads: {_fmt(nearest(divisors(m.d_model), m.n_heads))}")
    elif (m.d_model // m.n_heads) % 2:
        _error(lay, "model.n_heads", f"head dim model.d_model/model.n_heads = {m.d_model // m.n_heads} must be even "
               f"for RoPE; valid n_heads: "
               f"{_fmt(nearest([d for d in divisors(m.d_model) if (m.d_model // d) % 2 == 0], m.n_heads))}")
    if m.n_heads % m.n_kv_heads:
        _error(lay, "model.n_kv_heads", f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
               f"(GQA groups); valid n_kv_heads: {_fmt(nearest(divisors(m.n_heads), m.n_kv_heads))}")
    if m.n_heads % tp:
        _error(lay, "parallel.tp", f"parallel.tp={tp} does not divide model.n_heads={m.n_heads}; {vt_msg}")
    if m.n_kv_heads < tp:
        _error(lay, "parallel.tp", f"parallel.tp={tp} exceeds model.n_kv_heads={m.n_kv_heads}: KV heads are not "
               f"replicated across tp ranks here (that crashes mid-forward elsewhere, torchtitan #2577), so tp must "
               f"divide n_kv_heads; {vt_msg}")
    elif m.n_kv_heads % tp:
        _error(lay, "parallel.tp", f"parallel.tp={tp} does not divide model.n_kv_heads={m.n_kv_heads}; {vt_msg}")
    if m.ffn_hidden % tp:
        _error(lay, "parallel.tp", f"parallel.tp={tp} does not divide model.ffn_hidden={m.ffn_hidden}; {vt_msg}")
    lay.padded_vocab = -(-m.vocab_size // tp) * tp
    if lay.padded_vocab != m.vocab_size:
        lay.notes.append(f"model.vocab_size={m.vocab_size} padded to {lay.padded_vocab} (a multiple of tp={tp}); "
                         "the padding columns are masked out of the loss")
    if tp > dpn:
        _warn(lay, "parallel.tp", f"parallel.tp={tp} exceeds the {dpn} devices of a node: tensor parallel crosses "
              f"nodes (slow links on every layer); {vt_msg}")


def check_sequence_parallel(cfg: Config, lay: Layout) -> None:
    """Sequence parallel on by default with tp > 1; tp_overlap needs it."""
    p, tp = cfg.parallel, cfg.parallel.tp
    if p.sequence_parallel is None:
        lay.sequence_parallel = tp > 1
    elif p.sequence_parallel and tp == 1:
        lay.sequence_parallel = False
        _warn(lay, "parallel.sequence_parallel", "sequence_parallel=true has no effect with parallel.tp=1; ignored")
    else:
        lay.sequence_parallel = bool(p.sequence_parallel)
    if p.tp_overlap and tp == 1:
        _warn(lay, "parallel.tp_overlap", "tp_overlap=true has no effect with parallel.tp=1; ignored")
    elif p.tp_overlap and not lay.sequence_parallel:
        _error(lay, "parallel.tp_overlap", "parallel.tp_overlap=true fuses the sequence-parallel all-gathers and "
               "reduce-scatters into the GEMMs: it needs parallel.sequence_parallel=true (or tp_overlap=false)")
    lay.tp_overlap = bool(p.tp_overlap) and tp > 1
    if lay.tp_overlap and cfg.model.mla.kv_lora_rank > 0:
        _error(lay, "parallel.tp_overlap", "parallel.tp_overlap=true fuses GQA's q/k/v and o GEMMs with their "
               "collectives; it is not built for MLA (model.mla.kv_lora_rank > 0): use tp_overlap=false")


def check_pipeline_split(cfg: Config, lay: Layout) -> None:
    """Layers into pp·vpp chunks: even, or as parallel.pp_layout says. An invalid split still gets
    an even placeholder so memory and cost stay computable for the report."""
    m, p = cfg.model, cfg.parallel
    pp, chunks = p.pp, p.pp * lay.vpp
    if p.pp_layout is not None:
        lo = list(p.pp_layout)
        if len(lo) != chunks:
            _error(lay, "parallel.pp_layout", f"parallel.pp_layout has {len(lo)} entries but parallel.pp·vpp = "
                   f"{pp}·{lay.vpp} = {chunks} pipeline chunks need one layer count each")
        if sum(lo) != m.n_layers:
            _error(lay, "parallel.pp_layout", f"parallel.pp_layout sums to {sum(lo)} layers but "
                   f"model.n_layers={m.n_layers}")
        empty = [c for c, k in enumerate(lo) if k == 0 and 0 < c < len(lo) - 1]
        if empty:  # an empty chunk must hold the embedding or the head; a middle one would only relay
            _error(lay, "parallel.pp_layout", f"parallel.pp_layout gives chunk {empty[0]} no layers: only the "
                   f"first chunk (the embedding) or the last (the head, MTP) may hold 0 layers")
        if len(lo) == chunks and sum(lo) == m.n_layers and not empty:
            lay.stage_layers = stage_layers(m.n_layers, lo)
    elif m.n_layers % chunks:
        okp = [q for q in range(1, m.n_layers + 1) if m.n_layers % (q * lay.vpp) == 0]
        base, rem = divmod(m.n_layers, chunks)
        even = [base + 1] * rem + [base] * (chunks - rem) if chunks <= 64 else []
        # with vpp > 1 and no pp that works for it, the interleaving degree is the field to change
        field = "parallel.vpp" if lay.vpp > 1 and not okp else "parallel.pp"
        _error(lay, field, f"model.n_layers={m.n_layers} is not divisible into parallel.pp·parallel.vpp = "
               f"{pp}·{lay.vpp} = {chunks} equal chunks; valid parallel.pp with parallel.vpp={lay.vpp}: "
               f"{_fmt(nearest(okp, pp))}"
               + (f"; or give an uneven split, e.g. parallel.pp_layout=[{','.join(map(str, even))}]"
                  if even and base else ""))
    else:
        lay.stage_layers = stage_layers(m.n_layers, [m.n_layers // chunks] * chunks)
    if not lay.stage_layers:
        base, rem = divmod(m.n_layers, chunks)
        lay.stage_layers = stage_layers(m.n_layers, [base + (1 if i < rem else 0) for i in range(chunks)])


def check_context_parallel(cfg: Config, lay: Layout) -> None:
    """cp shards the sequence into 2·cp zigzag chunks; with SP each cp rank's tokens split over tp."""
    m, cp, tp = cfg.model, cfg.parallel.cp, cfg.parallel.tp
    if cp > 1 and m.seq_len % (2 * cp):
        okc = divisors(m.seq_len // 2)
        _error(lay, "parallel.cp", f"model.seq_len={m.seq_len} must be divisible by 2·parallel.cp = {2 * cp} "
               f"(zigzag sharding into 2·cp chunks); valid cp: {_fmt(nearest(okc, cp))}")
    if lay.sequence_parallel and (m.seq_len % (cp * tp)):
        _error(lay, "model.seq_len", f"with sequence parallel, the tokens per microbatch on a cp rank "
               f"(model.seq_len/parallel.cp = {m.seq_len}/{cp}) must be divisible by parallel.tp={tp}; use seq_len a "
               f"multiple of {cp * tp}{' and of ' + str(2 * cp) if cp > 1 else ''}, or "
               "parallel.sequence_parallel=false")


def check_experts(cfg: Config, lay: Layout) -> None:
    """Experts split over ep (a grid carved out of dp·cp); top_k and every within the model."""
    m, ep, dp, cp = cfg.model, cfg.parallel.ep, lay.dp, cfg.parallel.cp
    E = m.moe.num_experts
    if E > 0:
        # (no expert-width rule for tp: experts are replicated over tp, split only by ep)
        if m.moe.top_k > E:
            _error(lay, "model.moe.top_k", f"model.moe.top_k={m.moe.top_k} exceeds model.moe.num_experts={E}; "
                   f"valid top_k: 1..{E}")
        if E % ep:
            _error(lay, "parallel.ep", f"parallel.ep={ep} does not divide model.moe.num_experts={E}; valid ep: "
                   f"{_fmt([d for d in divisors(E) if (dp * cp) % d == 0] or divisors(E))}")
        if m.moe.every > m.n_layers:
            _error(lay, "model.moe.every", f"model.moe.every={m.moe.every} exceeds model.n_layers={m.n_layers}: no "
                   f"layer would be MoE; valid: 1..{m.n_layers}")
        if m.moe.capacity_factor is not None and cp > 1:
            # capacity is per rank's own tokens (model/moe.py): a cp rank holds 1/cp of each
            # sequence, so it would keep and drop other tokens than one process (issue #25)
            _error(lay, "model.moe.capacity_factor", f"model.moe.capacity_factor={m.moe.capacity_factor} with "
                   f"parallel.cp={cp}: capacity is applied to each rank's own tokens, and a context-parallel "
                   "rank holds only 1/cp of every sequence, so it would drop other tokens than one process "
                   "does; use model.moe.capacity_factor=null (dropless) or parallel.cp=1")
    elif ep > 1:
        _error(lay, "parallel.ep", f"parallel.ep={ep} needs experts: model.moe.num_experts is 0 (dense); use ep=1 or "
               f"set model.moe.num_experts to a multiple of {ep}")
    if ep > 1 and (dp * cp) % ep:
        _error(lay, "parallel.ep", f"parallel.ep={ep} must divide dp·cp = {dp}·{cp} = {dp * cp} (dp from "
               f"{dp_source(cfg, lay)}; the expert grid is carved out of the data/context-parallel ranks); valid ep: "
               f"{_fmt([d for d in divisors(dp * cp) if E == 0 or E % d == 0])}")
    if E > 0 and ep > 1 and E % ep == 0 and E // ep == 1:
        _warn(lay, "parallel.ep", f"one expert per rank (num_experts={E}, ep={ep}): every routed token crosses the "
              "all-to-all and the busiest expert sets the pace")


def overlap_refusal(cfg: Config, schedule: str, ep: int, tp: int, cp: int, zero: int) -> Optional[str]:
    """Why parallel.pp_overlap does not apply to (or is not built for) this layout; None: it runs.
    The planner asks it of every layout it weighs (an unset pp_overlap is on where it applies)."""
    if schedule != "dualpipev":
        return f"parallel.schedule=dualpipev (the overlapped actions are DualPipe's; got schedule={schedule})"
    if cfg.model.moe.num_experts == 0 or ep < 2:
        return "parallel.ep > 1 (the halves switch at the expert all-to-alls; got " \
               f"ep={ep}{', a dense model' if cfg.model.moe.num_experts == 0 else ''})"
    if tp > 1 or cp > 1 or zero >= 2:
        return "parallel.tp=1, parallel.cp=1 and parallel.zero <= 1 (not built with tensor, context or " \
               f"ZeRO-2/3 sharding yet; got tp={tp}, cp={cp}, zero={zero})"
    return None


def check_overlap(cfg: Config, lay: Layout) -> None:
    """parallel.pp_overlap: DualPipe's overlapped forward-backward (parallel/pipeline/overlap.py).

    Default (null) on wherever it applies: dualpipev with ep > 1. DualPipe exists to hide the
    expert all-to-all and the pipeline sends under a second microbatch's compute (DeepSeek-V3
    §3.2.1), and the overlap changes no number (losses and gradients equal the serial order bit
    for bit), so a run that chose dualpipev for MoE gets it, as DeepSeek ran it. Megatron-Core's
    switch for the same overlap (``overlap_moe_expert_parallel_comm``) is off by default, as
    its overlaps are opt-in there; here the opt-in is the schedule. Asked for explicitly where it does
    not apply or is not built: exit 2 naming this field."""
    p = cfg.parallel
    ask = p.pp_overlap
    why = overlap_refusal(cfg, p.schedule, p.ep, p.tp, p.cp, int(p.zero))
    if ask and why:
        _error(lay, "parallel.pp_overlap", f"parallel.pp_overlap=true needs {why}; valid: false, or null "
               "(on where it applies)")
    lay.pp_overlap = why is None and ask is not False


def check_model_parts(cfg: Config, lay: Layout) -> None:
    """The model parts not built under some layouts (runtime/build.py refuses them too): refused here,
    before any rank starts, so the front door exits 2 naming the field."""
    m, p = cfg.model, cfg.parallel
    if m.mtp.depth > 0:
        why = ("parallel.cp > 1 (MTP reads the token k ahead, on another context rank)" if p.cp > 1 else
               "parallel.zero=3 (ZeRO-3 reshards the embedding and head before the MTP loss runs)" if int(p.zero) >= 3
               else "model.tie_embeddings under parallel.pp > 1 (three copies of the shared table)"
               if p.pp > 1 and m.tie_embeddings else None)
        if why:
            _error(lay, "model.mtp.depth", f"model.mtp.depth={m.mtp.depth} is not built with {why}; use "
                   "model.mtp.depth=0 or change the layout")
    if m.moe.num_experts > 0 and m.moe.seq_aux_loss_coef > 0 and p.cp > 1:
        # a sequence's balance loss needs its whole sequence's routing; each cp rank holds a zigzag shard
        _error(lay, "model.moe.seq_aux_loss_coef", f"model.moe.seq_aux_loss_coef={m.moe.seq_aux_loss_coef} is not "
               "built with parallel.cp > 1 (each context rank holds part of every sequence); use "
               "model.moe.seq_aux_loss_coef=0 or parallel.cp=1")
    if m.mla.kv_lora_rank > 0 and p.tp > 1 and p.tp_overlap:
        _error(lay, "parallel.tp_overlap", "parallel.tp_overlap=true is not built with MLA (model.mla.kv_lora_rank="
               f"{m.mla.kv_lora_rank}); valid: false")


def check_batch(cfg: Config, lay: Layout) -> None:
    """global_batch = micro_batch · dp · m; the pipeline schedules' needs on m."""
    t, sched, pp, dp = cfg.train, cfg.parallel.schedule, cfg.parallel.pp, lay.dp
    gb, mb = t.global_batch, t.micro_batch
    lay.microbatches = max(gb // (mb * dp), 1)
    if gb % (mb * dp):
        okmb = divisors(gb // dp) if gb % dp == 0 else []
        _error(lay, "train.global_batch", f"train.global_batch={gb} must be divisible by train.micro_batch·dp = "
               f"{mb}·{dp} = {mb * dp} (dp from {dp_source(cfg, lay)}); nearest valid global_batch: {_fmt(_multiples_near(gb, mb * dp))}"
               + (f"; valid train.micro_batch: {_fmt(nearest(okmb, mb))}" if okmb else ""))
    if pp > 1:
        _check_microbatches(lay, sched, pp, gb, mb, dp, dp_source(cfg, lay))


def check_eval(cfg: Config, lay: Layout) -> None:
    """Validation (paralayer/runtime/evaluate.py) needs a held-out corpus to read."""
    held_out = getattr(cfg.data, "valid", None) or float(getattr(cfg.data, "valid_fraction", 0.0) or 0.0) > 0
    if getattr(cfg.train, "eval_every", 0) > 0 and not held_out:
        _error(lay, "train.eval_every", f"train.eval_every={cfg.train.eval_every} needs held-out data: set "
               "data.valid=PATH (read with data.format) or data.valid_fraction=F (0 < F < 1), or "
               "train.eval_every=0 (never)")


def _check_microbatches(lay: Layout, sched: str, pp: int, gb: int, mb: int, dp: int, dp_from: str) -> None:
    mm = lay.microbatches
    need = 2 * pp if sched == "dualpipev" else pp
    if mm < need and sched != "gpipe":
        _error(lay, "train.global_batch", f"microbatches m = train.global_batch/(train.micro_batch·dp) = "
               f"{gb}/({mb}·{dp}) = {mm} (dp from {dp_from}) but parallel.schedule={sched} needs m >= "
               f"{'2·pp' if sched == 'dualpipev' else 'pp'} = {need}; use train.global_batch >= {need * mb * dp} "
               "or a smaller train.micro_batch")
    elif mm < pp:
        _warn(lay, "train.global_batch", f"m = {mm} < pp = {pp}: the pipeline never fills")
    if sched == "interleaved" and mm % pp:
        _error(lay, "train.global_batch", f"parallel.schedule=interleaved runs microbatches in groups of pp: m = {mm} "
               f"must be a multiple of parallel.pp={pp}; nearest valid global_batch: "
               f"{_fmt(_multiples_near(gb, pp * mb * dp))}")
    if mm < 4 * pp:
        _warn(lay, "train.global_batch", f"m = {mm} microbatches < 4·pp = {4 * pp}: the pipeline bubble is large; "
              "raise train.global_batch or lower train.micro_batch")
    if sched == "zbv" and mm < 2 * pp:
        _warn(lay, "train.global_batch", f"zbv is bubble-free only with m >= 2·pp = {2 * pp} (got m = {mm})")
