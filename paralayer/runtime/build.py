"""Building one rank's model, optimizer, LR schedule and loss from the plan.

The parallelism is applied in the design's order (pipeline split → tensor/sequence → context →
expert → recompute → compile → data/ZeRO), then the weights are materialised with the
layout-independent init. paralayer/runtime/train.py runs the loop over what this builds.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from paralayer.config import Config
from paralayer.model.compile import compile_blocks, compile_loss
from paralayer.model.transformer import Transformer, init_weights, lm_loss
from paralayer.parallel import data as dpar
from paralayer.parallel import tied_embeddings as tied
from paralayer.parallel.grad_scaling import GradScaling, cp_loss_weight
from paralayer.parallel.mesh import Meshes
from paralayer.resolve.plan import Plan
from paralayer.runtime import moe_step, optimizer, precision


def as_plan(plan: Union[Plan, dict]) -> Plan:
    """The typed plan; ``plan.json`` read as a dict becomes a :class:`Plan` (missing keys raise)."""
    return plan if isinstance(plan, Plan) else Plan.from_dict(plan)



# ------------------------------------------------------------------ building
def resolve_device(plan: Plan) -> torch.device:
    """The plan's device: CUDA (this rank's LOCAL_RANK GPU, set by the launcher) or CPU. A cuda plan
    where no CUDA device is visible is an error naming the rank, never a silent CPU run."""
    if plan.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: the plan runs on cuda but no CUDA device is "
                               "visible to this process; nothing was trained on CPU")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def apply_recompute(model: Transformer, mode: str, every: int = 1, fp8_cache: bool = False) -> None:
    """none; swiglu: the SwiGLU activation and product (in an MoE block, each expert's and the
    shared expert's); core_attn: RoPE and the attention core; selective: both, but an MoE block's
    experts are left alone (as the plan counts them); norm_up (DeepSeek-V3's): every block's norms,
    MLA's latent norms and up-projections, and the MoE blocks' SwiGLU as swiglu does; full: each
    block from its input, on layers i with i % every == 0 (global index: the same layers under any pipeline split;
    resolve.memory.layer_recompute). The MTP depths' blocks (layer ids n_layers + k, on the last
    chunk) are recomputed by the same rule. ``fp8_cache`` (train.fp8.cache_activations, with
    swiglu or norm_up): the MoE blocks' recomputed SwiGLU keeps its inputs in FP8 (model/float8.py Fp8Tiles)."""
    mtp = getattr(model, "mtp", None)
    blocks = list(model.layers.values()) + ([d.block for d in mtp.layers.values()] if mtp is not None else [])
    for layer in blocks:
        if mode == "full":
            layer.recompute_full = layer.layer_id % every == 0
        if mode in ("core_attn", "selective"):
            layer.attention.recompute_core = True
        if mode in ("swiglu", "selective") and hasattr(layer.feed_forward, "recompute_act"):
            layer.feed_forward.recompute_act = True
        if mode in ("swiglu", "norm_up") and hasattr(layer.feed_forward, "recompute_expert_act"):  # an MoE block
            layer.feed_forward.recompute_expert_act = True
            if fp8_cache:
                from paralayer.model.float8 import Fp8Tiles

                layer.feed_forward.fp8_cache = Fp8Tiles()
                if layer.feed_forward.shared is not None:
                    layer.feed_forward.shared.fp8_cache = layer.feed_forward.fp8_cache
        if mode == "norm_up":
            layer.recompute_norms = True
            if hasattr(layer.attention, "recompute_up"):  # MLA
                layer.attention.recompute_up = True


@dataclass
class Built:
    chunks: list[Transformer]
    meshes: Meshes
    device: torch.device
    params: list[nn.Parameter]
    expert_params: list[nn.Parameter] = field(default_factory=list)
    pipeline: Any = None


def build_model(cfg: Config, plan: Union[Plan, dict], meshes: Meshes, device: torch.device,
                materialize: Optional[Any] = None) -> Built:
    """Apply parallelism in the order the design gives, then materialise the weights.

    ``materialize``: a context the weights are materialised in (the rehearsal's FakeTensorMode:
    the model is split and sharded on the meta device outside it, and gets shapes without storage)."""
    plan = as_plan(plan)
    d = plan.degrees
    tp, pp, cp, ep = (int(d[k]) for k in ("tp", "pp", "cp", "ep"))
    if cp > 1 and cfg.model.moe.num_experts > 0 and cfg.model.moe.seq_aux_loss_coef > 0:
        # a sequence's balance loss needs its whole sequence's counts; under cp each rank holds a
        # zigzag shard of it (not built: refused rather than computed per shard)
        raise ValueError("model.moe.seq_aux_loss_coef > 0 is not built under parallel.cp > 1; "
                         "set parallel.cp=1 or model.moe.seq_aux_loss_coef=0")
    if cfg.model.mtp.depth > 0 and (cp > 1 or (pp > 1 and cfg.model.tie_embeddings) or int(cfg.parallel.zero) >= 3):
        # MTP reads t_{i+k}, on another context rank under cp; tied + MTP under pp = three copies;
        # ZeRO-3 reshards the embedding and head after the stage's forward, before the loss runs MTP
        raise ValueError("model.mtp.depth > 0 is not built with parallel.cp > 1, parallel.zero=3, nor "
                         "model.tie_embeddings under parallel.pp > 1")
    if cfg.model.mla.kv_lora_rank > 0 and tp > 1 and cfg.parallel.tp_overlap:
        raise ValueError("model.mla (latent attention) is not built with parallel.tp_overlap")
    with torch.device("meta"):
        model = Transformer(cfg.model, plan.padded_vocab_size)
    if pp > 1:
        from paralayer.parallel import pipeline

        chunks = pipeline.split_model(model, plan, meshes.local_rank("pp"))
    else:
        chunks = [model]
    zero, dp_cp = int(cfg.parallel.zero), meshes.size("dp_cp")
    if cfg.train.precision == "fp8":  # on the meta model, before tp (its FP8 styles need the swap)
        # tp moves FP8 where the PLAN's device does (NCCL; a GPU plan's rehearsal too), not under cp
        # (torchao's styles scale over tp only: resolve/fp8_blocks.tp_styles)
        gpu = device.type == "cuda" or str(getattr(plan, "device", "")) == "cuda"
        convert_fp8(cfg, chunks, meshes, device, fsdp=zero >= 2 and dp_cp > 1, fp8_comm=gpu and meshes.size("cp") == 1)
    for chunk in chunks:
        if tp > 1:
            from paralayer.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(chunk, meshes["tp"], bool(plan.sequence_parallel), overlap=bool(plan.tp_overlap))
        if cp > 1:
            from paralayer.parallel.context.layers import apply_context_parallel

            apply_context_parallel(chunk, meshes["cp"].get_group(), cfg.model.seq_len)
        if ep > 1:
            from paralayer.parallel.expert import apply_expert_parallel

            for ff in expert_blocks(chunk):
                apply_expert_parallel(ff, meshes["ep"].get_group())
            # each ep rank's node: the rows sent are counted by destination (``ep_bytes_sent``), and
            # under the plan's dispatch by node they travel once per node (parallel/expert_node.py)
            from paralayer.parallel.expert_node import apply_node_dispatch, nodes_of_group, set_node_map

            node_of = nodes_of_group(meshes["ep"].get_group(), plan.devices_per_node)
            for ff in expert_blocks(chunk):
                set_node_map(ff, node_of)
                ff.ep_cp = cp if ep % cp == 0 else 1  # FP8: the cp ranks of a micro-batch scaled together
                if (plan.comm.get("ep") or {}).get("dispatch") == "node":
                    apply_node_dispatch(ff, node_of)
        apply_recompute(chunk, cfg.parallel.recompute, cfg.parallel.recompute_every,
                        cfg.train.fp8.cache_activations)
        if cfg.train.compile:  # after tp/cp/ep/recompute, before FSDP (torchtitan's order)
            compile_blocks(chunk, cfg.train.compile_backend, tp=tp, cp=cp)
    expert_names: set[str] = set()
    if cfg.model.moe.num_experts > 0 and ep > 1:  # ep=1: experts are ordinary data-parallel weights
        from paralayer.parallel.expert import is_expert_param

        for chunk in chunks:
            expert_names |= {n for n, _ in chunk.named_parameters() if is_expert_param(n)}
    if zero >= 2 and dp_cp > 1:
        for chunk in chunks:
            dpar.apply_fsdp(chunk, meshes["dp_cp"], zero,
                            param_dtype=precision.fsdp_param_dtype(precision.mode(cfg, device, dp_cp)),
                            expert_mesh=meshes["edp"] if ep > 1 else None)
    with materialize if materialize is not None else contextlib.nullcontext():
        _materialize(cfg, chunks, device)
    params = [p for c in chunks for p in c.parameters()]
    expert_params = [p for c in chunks for n, p in c.named_parameters() if n in expert_names]
    return Built(chunks=chunks, meshes=meshes, device=device, params=params, expert_params=expert_params)


def convert_fp8(cfg: Config, chunks: list, meshes: Meshes, device: torch.device, fsdp: bool,
                fp8_comm: bool = False) -> None:
    """train.precision=fp8: the blocks' GEMMs to FP8 (paralayer/model/float8.py); the blocks and the
    recipe are the resolver's (resolve/fp8.py). Emulated on CPU, which rank 0 says in one line."""
    from paralayer.model.float8 import convert_blocks
    from paralayer.resolve.fp8 import fp8_layers

    recipe, emulate = cfg.train.fp8.recipe, device.type != "cuda"
    # blockwise's token tiles (128) lie inside a cp chunk (resolve/fp8.py): no scale spans cp ranks
    cp_mesh = meshes["cp"] if meshes.size("cp") > 1 and recipe in ("tensorwise", "rowwise") else None
    for chunk in chunks:
        convert_blocks(chunk, recipe, fp8_layers(cfg), emulate=emulate, fsdp_float8_all_gather=fsdp,
                       token_mesh=cp_mesh, fp8_comm=fp8_comm,
                       expert_token_mesh=cp_mesh if meshes.size("ep") == 1 else None)
        chunk.fp8_fsdp_all_gather = fsdp and recipe == "tensorwise"
    if emulate and dist.is_initialized() and dist.get_rank() == 0:
        print(f"paralayer: train.precision=fp8 ({recipe}) runs emulated on {device.type}: the blocks' GEMMs take "
              f"FP8 casts, the matmuls run in {'fp64' if torch.get_default_dtype() == torch.float64 else 'fp32'}",
              flush=True)


def expert_blocks(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's MoE feed-forwards that expert parallel splits: its layers' and its MTP depths'
    (the last chunk's; left whole, each ep rank would hold all their experts and reduce their
    gradients over the wrong group)."""
    from paralayer.model.mtp import moe_blocks

    out = [layer.feed_forward for layer in chunk.layers.values() if getattr(layer, "is_moe", False)]
    return out + moe_blocks(getattr(chunk, "mtp", None))


def _materialize(cfg: Config, chunks: list, device: torch.device) -> None:
    """Weights for the meta model: a Hugging Face checkpoint or the layout-independent init."""
    for chunk in chunks:
        chunk.to_empty(device=device)
        for mod in chunk.modules():  # buffers to_empty left uninitialised (MoE router bias)
            if hasattr(mod, "reset_buffers"):
                mod.reset_buffers()
        if cfg.model.init.startswith("hf:"):  # after: a DeepSeek-V3 checkpoint carries the router bias
            from paralayer.checkpoint.hf import load_hf_weights

            load_hf_weights(chunk, cfg.model.init[3:], cfg.model, seed=cfg.train.seed)
        else:
            init_weights(chunk, cfg.model, cfg.train.seed, device)
        for buf_name, buf in chunk.named_buffers():
            if buf.is_meta:  # pragma: no cover - every buffer of ours is re-creatable
                raise RuntimeError(f"buffer {buf_name} left on meta")


def lr_lambda(cfg: Config):
    """The LR multiplier after ``step`` optimizer steps: linear warmup to 1 over ``warmup_steps``
    (step k of the run, 1-based, gets k / warmup_steps), then cosine to ``min_lr_ratio`` at ``steps``."""
    t = cfg.train

    def f(step: int) -> float:  # step counts optimizer steps already taken (0-based)
        s = step + 1
        if t.warmup_steps and s <= t.warmup_steps:
            return s / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (s - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(cfg: Config, built: Built, meshes: Meshes):
    """AdamW (``train.optimizer=muon``: Muon and AdamW) over this rank's parameters (ZeRO-1: over its
    share), in the groups of paralayer/runtime/optimizer.py (``train.weight_decay_1d``), and the
    LambdaLR of :func:`lr_lambda`."""
    t = cfg.train

    def make(params):  # fused on CUDA, foreach elsewhere (paralayer/runtime/optimizer.py)
        return optimizer.adamw(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                               eps=t.adam_eps, decay_1d=t.weight_decay_1d)

    if t.optimizer == "muon":
        make = optimizer.muon_maker(cfg, built, meshes)

    if int(cfg.parallel.zero) == 1 and meshes.size("dp_cp") > 1:
        dp_mesh = meshes["dp_cp"]
        group_ranks = dist.get_process_group_ranks(dp_mesh.get_group())
        opt = dpar.ZeroOneOptimizer(built.params, dp_mesh.get_group(), dp_mesh.get_local_rank(),
                                    dp_mesh.size(), group_ranks, make, local_params=built.expert_params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lr_lambda(cfg))
    else:
        opt = make(built.params)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return opt, sched


# ------------------------------------------------------------------ loss
def make_loss_fn(cfg: Config, plan: Union[Plan, dict], n_valid_global_per_seq: int,
                 mtp_chunk: Optional[torch.nn.Module] = None):
    """Per-microbatch loss whose average over the dp·cp ranks is the global mean CE.

    Context ranks hold unequal numbers of valid labels (the sequence's last position has none),
    so the local mean is re-weighted (``cp_loss_weight``, the gradient-scaling contract).
    ``mtp_chunk``: the chunk holding the MTP depths (the last), whose loss joins the gradient.
    """
    plan = as_plan(plan)
    tp = int(plan.degrees["tp"])
    cp = int(plan.degrees["cp"])
    vocab = cfg.model.vocab_size
    ce = compile_loss(lm_loss, cfg.train.compile_backend) if cfg.train.compile and tp == 1 else lm_loss

    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if tp > 1:
            from paralayer.parallel.tensor import tp_loss

            return tp_loss(logits, labels, vocab)
        return ce(logits, labels, vocab)  # cross_entropy ignores the -100 labels

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n_local = (labels != -100).sum()
        n_global = labels.shape[0] * n_valid_global_per_seq
        mean = cross_entropy(logits, labels)
        if mtp_chunk is not None and mtp_chunk.mtp_input is not None:
            # value: the next-token CE alone (what ``loss`` logs); gradient: also L_MTP's
            extra = mtp_objective(mtp_chunk, labels, cross_entropy, cfg.model.moe)
            mean = mean + (extra - extra.detach())
        if cp == 1:
            return mean
        return mean * cp_loss_weight(n_local.to(mean.dtype), n_global, cp)

    return loss_fn


def mtp_objective(chunk: torch.nn.Module, labels: torch.Tensor, cross_entropy, moe) -> torch.Tensor:
    """L_MTP = λ/D·Σ_k CE_k (model/mtp.py), plus the balance losses of the MTP depths' MoE blocks
    (they run here, after the stage's aux-loss hook); L_MTP is added to the step's ``mtp_loss``."""
    from paralayer.model.mtp import moe_blocks

    mtp = chunk.mtp
    ces = [cross_entropy(logits, targets) for logits, targets in chunk.mtp_outputs(labels)]
    l_mtp = (mtp.loss_weight / mtp.depth) * torch.stack([c.float().reshape(()) for c in ces]).sum()
    if getattr(mtp, "read_loss", True):  # False in the rehearsal: fake tensors have no value to read
        mtp.loss_sum += float(l_mtp.detach())
        mtp.forwards += 1
    total = l_mtp
    for ff in moe_blocks(mtp):
        if ff.aux_loss is not None and moe.aux_loss_coef:
            total = total + moe.aux_loss_coef * ff.aux_loss
        if ff.seq_aux_loss is not None:
            total = total + moe.seq_aux_loss_coef * ff.seq_aux_loss
    return total


# ------------------------------------------------------------------ the rest of a rank's setup
def grad_scaling(plan: Plan, meshes: Meshes) -> GradScaling:
    """The gradient-scaling contract's factors for this layout (paralayer/parallel/grad_scaling.py)."""
    return GradScaling(microbatches=int(plan.microbatches), pp=int(plan.degrees["pp"]),
                       dp_cp=meshes.size("dp_cp"), ep=int(plan.degrees["ep"]), zero=int(plan.zero))


def build_reducer(scaling: GradScaling, built: Built, meshes: Meshes):
    """ZeRO-0/1 over dp·cp > 1: the bucketed gradient reducer; otherwise None (FSDP or one rank)."""
    if not scaling.uses_reducer:
        return None
    dp_cp = meshes["dp_cp"]
    edp_group = meshes["edp"].get_group() if meshes.expert is not None else None
    return dpar.GradReducer(built.params, dp_cp.get_group(), dp_cp.size(), built.expert_params, edp_group,
                            microbatches=scaling.microbatches, divide=scaling.reducer_divisor)


def build_tied_group(cfg: Config, plan: Plan, meshes: Meshes):
    """Tied embeddings under pp: the (first, last) pipeline pair that sums the embedding and head
    grads; None when they sit on one rank (pp = 1, or the V schedules keep both on pp rank 0)."""
    pp = int(plan.degrees["pp"])
    if not (tied.shares_embedding(cfg.model, pp) and pp > 1 and plan.schedule not in ("zbv", "dualpipev")):
        return None
    w = meshes.world.mesh
    return tied.pair_group(w.permute(1, 2, 3, 0).reshape(-1, w.shape[0]).tolist(), dist.get_rank())


def build_data(cfg: Config):
    """The packed token dataset the recipe names (cached in data.cache_dir, default ~/.cache/paralayer)."""
    from paralayer.data.dataset import build_dataset

    cache_dir = cfg.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "paralayer")
    return build_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cache_dir,
                         global_batch=cfg.train.global_batch, vocab_size=cfg.model.vocab_size)


def build_runner(run: Any):
    """pp > 1: the pipeline schedule over this rank's chunks; None otherwise."""
    cfg, d = run.cfg, run.degree
    if d["pp"] == 1:
        return None
    from paralayer.parallel.pipeline import PipelineRunner

    moe = cfg.model.moe
    runner = PipelineRunner(run.built.chunks, run.meshes["pp"], run.plan, run.loss_fn, run.device,
                            microbatch_shape=(cfg.train.micro_batch, cfg.model.seq_len // d["cp"]),
                            loss_parallel=d["tp"] > 1,
                            aux_loss_coef=moe.aux_loss_coef if moe.num_experts > 0 else 0.0,
                            seq_aux_loss_coef=moe.seq_aux_loss_coef if moe.num_experts > 0 else 0.0,
                            scale_grads=run.scaling.schedule_scales,
                            # ZeRO 2/3: reduce-scatter every microbatch (1/dp of the grads at the peak)
                            reduce_each_microbatch={2: "grads", 3: "weights"}.get(int(cfg.parallel.zero)),
                            rehearse=run.rehearsing, autocast_dtype=run.autocast_dtype,
                            pp_overlap=bool(run.plan.pp_overlap))
    moe_step.count_real_forwards_only(runner, run.built.chunks)
    return runner


def agree_peak_tflops(cfg: Config, device: torch.device) -> tuple[Optional[float], str]:
    """Rank 0 resolves the peak (configured, or measured on CPU) and every rank takes its value."""
    from paralayer import metrics as metrics_mod

    peak, source = None, "rank 0"
    if dist.get_rank() == 0:
        peak, source = metrics_mod.resolve_peak_tflops(device, cfg.cluster.peak_tflops, torch.get_num_threads())
    t = torch.tensor([peak or 0.0], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item()) or None, source

