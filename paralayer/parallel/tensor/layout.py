"""Tensor parallel (Megatron-style, by DTensor) with optional sequence parallel.

Layout for one rank of a ``tp``-sized group (see docs/tensor-parallel.md and docs/tp-layout.png):

    tok_embeddings   RowwiseParallel   weight Shard(0): a slice of the vocabulary rows; the lookup
                                       returns a partial sum, reduced to Shard(1) (SP: reduce-scatter
                                       over the sequence) or Replicate (all-reduce)
    attention_norm   SequenceParallel  (SP only) the norm sees s/tp tokens
    attention        PrepareModuleInput  x: Shard(1) -> Replicate (no SP; under SP the column GEMMs
                                       gather it themselves and save only the shard:
                                       parallel/tensor/sequence_parallel.py)
      wq, wk, wv     ColwiseParallel   whole heads per rank (n_heads % tp == 0, n_kv_heads % tp == 0)
      wo             RowwiseParallel   partial sums -> Shard(1) (SP: reduce-scatter) or Replicate
    ffn_norm         SequenceParallel  (SP only; without SP the norms hold Replicate DTensors)
    post_*_norm      SequenceParallel  (Gemma 3's norms on wo's and w2's outputs; SP only, as above)
    feed_forward     PrepareModuleInput  (SP: all-gather)
      w1, w3         ColwiseParallel   gate / up split by columns, silu(gate)*up applied locally
      w2             RowwiseParallel   down split by rows: one reduction restores the exact sum
    norm             SequenceParallel  (SP only)
    output           ColwiseParallel   vocab columns; logits stay a DTensor Shard(-1) (never gathered)

Per layer, forward: 2 all-reduces (no SP) or 2 all-gathers + 2 reduce-scatters (SP); backward the
same again (the conjugate collectives). The residual stream between the blocks is a plain local
tensor: (b, s/tp, d) under SP, (b, s, d) replicated without it.

The loss over the vocab-sharded logits: paralayer/parallel/tensor/loss.py.

MoE blocks are not split by tensor parallel: their input is gathered to the full sequence and the
expert block runs replicated on every tp rank (expert parallelism is the axis that splits them).

Under sequence parallel the embedding hands the blocks s/tp tokens, while RoPE must see the full
sequence's positions: :func:`apply_tensor_parallel` installs a forward pre-hook on the model that
sets ``model.positions`` to the full ``arange`` when nothing else (context parallel) set it.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from paralayer.parallel.tensor.sequence_parallel import SpGemms


def check_tp_shapes(model: nn.Module, tp: int) -> None:
    """Raise ValueError naming the field if the model cannot be split ``tp`` ways."""
    cfg = model.cfg
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"model.n_heads={cfg.n_heads} is not divisible by parallel.tp={tp}")
    if cfg.n_kv_heads % tp:
        problems.append(f"model.n_kv_heads={cfg.n_kv_heads} is not divisible by parallel.tp={tp} "
                        "(KV heads are not replicated: choose tp dividing n_kv_heads)")
    if getattr(cfg, "linear", None) is not None and cfg.linear.k_heads % tp:
        problems.append(f"model.linear.k_heads={cfg.linear.k_heads} is not divisible by parallel.tp={tp}")
    if cfg.ffn_hidden % tp:
        problems.append(f"model.ffn_hidden={cfg.ffn_hidden} is not divisible by parallel.tp={tp}")
    if getattr(model, "vocab_padded", cfg.vocab_size) % tp:
        problems.append(f"padded vocab {model.vocab_padded} is not a multiple of parallel.tp={tp} "
                        "(build the model with padded_vocab(vocab_size, tp))")
    if problems:
        raise ValueError("; ".join(problems))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          overlap: bool = False) -> None:
    """Shard ``model`` (a full Transformer or a pipeline stage of it) over the 1-D ``tp_mesh``, in place.

    Call on the meta-device model, before ``to_empty`` and ``init_weights``. tp == 1 is a no-op.
    ``overlap`` (needs sequence parallel): the split linears keep their DTensor weights, but the
    all-gathers and reduce-scatters run inside the GEMMs, chunk by chunk (parallel/tensor/tp_overlap.py).
    """
    tp = tp_mesh.size()
    if tp == 1:
        return
    check_tp_shapes(model, tp)
    sp = bool(sequence_parallel)
    if overlap and not sp:
        raise ValueError("parallel.tp_overlap needs parallel.sequence_parallel=true")
    # Layout of the residual stream between blocks (and of what a pipeline stage sends on).
    stream = Shard(1) if sp else Replicate()

    _parallelize_root(model, tp_mesh, sp, stream)
    # Under SP the column GEMMs save this rank's sequence shard and re-gather it in backward
    # (Megatron's activation saving): bulk collectives (sequence_parallel.py) or, with overlap,
    # rings fused into the GEMMs (tp_overlap.py). Their linears' own DTensor hooks never run.
    fused = None
    if overlap:
        from paralayer.parallel.tensor.tp_overlap import TpOverlap

        fused = TpOverlap(tp_mesh.get_group())
    elif sp:
        fused = SpGemms(tp_mesh.get_group())
    for block in model.layers.values():
        _parallelize_block(block, tp_mesh, sp, stream, fused)
    if getattr(model, "mtp", None) is not None:
        _parallelize_mtp(model.mtp, tp_mesh, sp, stream, fused)

    model.tp_mesh = tp_mesh
    model.tp_sequence_parallel = sp
    # Registered at forward time: to_empty() (after this function) makes new parameter objects.
    model.register_forward_pre_hook(_hook_grads)
    if sp:
        model.register_forward_pre_hook(_full_positions_hook(tp))


def _parallelize_root(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, stream) -> None:
    """The embedding (vocab rows), the final norm and the head (vocab columns) this stage holds."""
    root_plan = {}
    if getattr(model, "tok_embeddings", None) is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if getattr(model, "norm", None) is not None:
        if sp:
            root_plan["norm"] = SequenceParallel()
        else:
            _replicate(model.norm, tp_mesh)
    if getattr(model, "output", None) is not None:
        # Input: the norm's output (a Shard(1) DTensor under SP) or, for a stage without a norm,
        # the plain residual stream; either way ``input_layouts`` says what a plain tensor means.
        root_plan["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                              use_local_output=False)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)


def _parallelize_mtp(mtp: nn.Module, tp_mesh: DeviceMesh, sp: bool, stream, fused) -> None:
    """The MTP depths (model/mtp.py): each block as the others; the norms and the (d, 2d)
    projection M_k replicated (d×2d is small beside the block; splitting it would add a
    collective per depth), sequence-parallel under SP like the norms (their weight grads come
    out Partial and are summed by :func:`align_grad`). The head norm hands the head a Shard(1)
    DTensor, as the final norm does. The last stage's embedding copy is split as the embedding."""
    for layer in mtp.layers.values():
        if sp:
            parallelize_module(layer, tp_mesh, {"enorm": SequenceParallel(use_local_output=True),
                                                "hnorm": SequenceParallel(use_local_output=True),
                                                "eh_proj": SequenceParallel(use_local_output=True),
                                                "norm": SequenceParallel()})
        else:
            for part in (layer.enorm, layer.hnorm, layer.eh_proj, layer.norm):
                _replicate(part, tp_mesh)
        _parallelize_block(layer.block, tp_mesh, sp, stream, fused)
    if mtp.embed is not None:
        parallelize_module(mtp, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)})


def _parallelize_block(block: nn.Module, tp_mesh: DeviceMesh, sp: bool, stream, fused) -> None:
    """One transformer block: attention and SwiGLU split Megatron-style, the norms sequence-
    parallel (or replicated), an MoE block run whole on the full sequence. ``fused``: the SP or
    overlap GEMMs the block calls instead of its linears' DTensor hooks (None without SP)."""
    latent = hasattr(block.attention, "kv_b")  # MLA (model/latent_attention.py)
    linear = hasattr(block.attention, "in_proj_qkvz")  # Gated DeltaNet (model/linear/)
    # an FP8 block (model/float8.py) takes its linears' own TP hooks, in the styles it names
    # (torchao's float8 ones for tensorwise: the SP all-gather in FP8), never the fused GEMMs
    fp8 = getattr(block, "fp8_tp_styles", None)
    colwise, rowwise, prepare = ((fp8["colwise"], fp8["rowwise"], fp8["prepare"]) if fp8
                                 else (ColwiseParallel, RowwiseParallel, PrepareModuleInput))
    if fp8 is not None:
        fused = None
    plan = _latent_plan(block.attention, tp_mesh, stream, colwise, rowwise) if latent else \
        _linear_plan(block.attention, tp_mesh, stream, colwise, rowwise) if linear else {
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=stream),
    }
    if fused is None or latent or linear:
        plan["attention"] = prepare(input_layouts=(stream, None, None),
                                    desired_input_layouts=(Replicate(), None, None))
    else:  # the linears' own hooks never run: Attention.forward calls the fused GEMMs
        block.attention.tp_overlap = fused
    if sp:
        # plain local chunks out under overlap (the fused GEMMs take them as they are)
        plan["attention_norm"] = SequenceParallel(use_local_output=fused is not None)
        plan["ffn_norm"] = SequenceParallel(use_local_output=fused is not None)
    else:
        _replicate(block.attention_norm, tp_mesh)
        _replicate(block.ffn_norm, tp_mesh)
    for post in ("post_attention_norm", "post_ffn_norm"):  # Gemma 3: on wo's / w2's plain output
        if getattr(block, post, None) is not None:
            if sp:  # s/tp tokens in and out, plain (the residual add takes it); weight grads summed
                plan[post] = SequenceParallel(use_local_output=True)
            else:
                _replicate(getattr(block, post), tp_mesh)
    for head_norm in (getattr(block.attention, "q_norm", None), getattr(block.attention, "k_norm", None)):
        if head_norm is not None:
            _replicate_over_heads(head_norm, tp_mesh)
    if getattr(block, "is_moe", False):
        # The expert block runs replicated on the full sequence (plain tensors in and out).
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(stream,),
                                                  desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
        if sp:
            block.feed_forward.register_forward_hook(_replicate_to_seq_shard(tp_mesh))
    else:
        plan.update({
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(output_layouts=stream),
        })
        if fused is None:
            plan["feed_forward"] = prepare(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        else:
            block.feed_forward.tp_overlap = fused
    parallelize_module(block, tp_mesh, plan)
    sinks = getattr(block.attention, "sinks", None)
    if sinks is not None:  # GPT-OSS: one logit per head, split with the heads (wq's rows)
        block.attention.sinks = nn.Parameter(distribute_tensor(sinks.data, tp_mesh, [Shard(0)]),
                                             requires_grad=sinks.requires_grad)


def _linear_plan(att: nn.Module, tp_mesh: DeviceMesh, stream, colwise=ColwiseParallel,
                 rowwise=RowwiseParallel) -> dict:
    """Gated DeltaNet: in_proj_qkvz / in_proj_ba column-parallel (whole k-heads with their v-heads),
    out_proj row-parallel; dt_bias and A_log split by rows (per v-head, in k-head order); the conv
    weight and the gated norm's gain replicated, each rank reading its heads' share
    (model/linear/gated_deltanet.py)."""
    from torch.distributed.tensor import distribute_tensor

    for name, place in (("dt_bias", Shard(0)), ("A_log", Shard(0))):
        setattr(att, name, nn.Parameter(distribute_tensor(getattr(att, name).data, tp_mesh, [place],
                                                          src_data_rank=None)))
    for mod in (att.conv1d, att.norm):
        mod.weight = nn.Parameter(distribute_tensor(mod.weight.data, tp_mesh, [Replicate()], src_data_rank=None))
    att.tp_size, att.tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    return {"attention.in_proj_qkvz": colwise(), "attention.in_proj_ba": colwise(),
            "attention.out_proj": rowwise(output_layouts=stream)}


def _latent_plan(att: nn.Module, tp_mesh: DeviceMesh, stream, colwise=ColwiseParallel,
                 rowwise=RowwiseParallel) -> dict:
    """MLA: the heads split (wq / q_b and kv_b column-parallel, wo row-parallel); the down-
    projections q_a, kv_a and their norms replicated, because their outputs (the latents, and the
    one rope key every head shares) are per token, not per head. They stay Replicate DTensors up to
    the column GEMMs, so the gradient each rank's heads send back arrives Partial and is summed; the
    shared rope key leaves DTensor land declared Partial for the same reason (``att.tp_mesh``)."""
    for part in (att.q_a, att.q_a_norm, att.kv_a, att.kv_a_norm):
        if part is not None:
            distribute_module(part, tp_mesh)
    att.tp_mesh = tp_mesh
    plan = {"attention.kv_b": colwise(), "attention.wo": rowwise(output_layouts=stream)}
    plan["attention.wq" if att.wq is not None else "attention.q_b"] = colwise()
    return plan


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parameters -> Replicate DTensors; plain replicated tensors in, plain tensors out.

    Used for the norms without SP, so that every parameter of a tp-split model is a DTensor on
    the tp mesh (foreach optimizers, clipping and checkpoints never mix the two kinds).
    """

    def input_fn(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def output_fn(mod, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, tp_mesh, None, input_fn, output_fn)


def _replicate_over_heads(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Qwen3's q/k norms: one (head_dim,) weight shared by every head, each rank holding n_heads/tp
    heads of its input (b, s, heads, head_dim). The input is declared Shard(2) (the heads), so the
    weight's gradient comes out Partial over tp and :func:`align_grad` sums it (all-reduce)."""

    def input_fn(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Shard(2)], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def output_fn(mod, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, tp_mesh, None, input_fn, output_fn)


def _hook_grads(module: nn.Module, args) -> None:
    for p in module.parameters():
        if isinstance(p, DTensor) and not getattr(p, "_tp_align_hooked", False):
            p.register_post_accumulate_grad_hook(align_grad)
            p._tp_align_hooked = True


def align_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: bring a DTensor grad to its parameter's placements, once per backward.

    SP norms' weight grads come out Partial (each rank saw s/tp tokens: one small all-reduce here
    instead of one per optimizer op); the vocab-parallel embedding's grad comes out Replicate (a
    local slice here, which also frees the full-size buffer). FSDP2 does the same for its params.
    """
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _replicate_to_seq_shard(tp_mesh: DeviceMesh):
    """Forward hook: a replicated full-sequence output -> this rank's Shard(1) local chunk."""

    def hook(module, args, out):
        if isinstance(out, DTensor):
            out = out.to_local()
        d = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return d.redistribute(tp_mesh, [Shard(1)]).to_local()

    return hook


def _full_positions_hook(tp: int):
    """Under SP the blocks see s/tp tokens, but RoPE needs the full sequence's positions."""

    def hook(module, args):
        if module.positions is not None and not getattr(module, "_tp_positions_set", False):
            return None  # set by someone else (context parallel): already the right positions
        x = args[0]
        first_stage = getattr(module, "tok_embeddings", None) is not None
        s = x.shape[1] if first_stage else x.shape[1] * tp
        pos = module.positions
        if pos is None or pos.shape[-1] != s or pos.device != x.device:
            module.positions = torch.arange(s, device=x.device)
            module._tp_positions_set = True
        return None

    return hook


# ------------------------------------------------------------------ helpers for tests and metrics
def full_grads(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full gradient) for every parameter, gathering DTensor shards (collective: all ranks)."""
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            yield name, None
            continue
        yield name, g.full_tensor() if isinstance(g, DTensor) else g


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total
