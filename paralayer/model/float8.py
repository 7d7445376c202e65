"""FP8 training of the blocks' GEMMs (train.precision=fp8): torchao's float8 for the tensorwise and
rowwise recipes, an emulation of DeepSeek-V3's blockwise recipe written here.

What runs in FP8: every nn.Linear inside a block (attention projections, the SwiGLU MLP, the MoE
shared expert) but the router, and the MoE experts' GEMMs, on the blocks paralayer/resolve/fp8.py
lists (the first/last ``train.fp8.bf16_*_blocks`` stay in the base precision, as do the attention
core, norms, embedding, head and MTP depths). Applied on the meta model after the pipeline split and
before tensor parallel, as torchtitan's float8 converter does (its TP styles need Float8Linear).

Recipes (``recipe_config``):
- tensorwise: one scale per tensor for the input, the weight and the output gradient (e4m3 / e5m2).
  Under tp the TP styles become torchao's Float8Colwise/RowwiseParallel + PrepareFloat8ModuleInput
  (the sequence-parallel all-gather carries FP8); their casts run on DTensors, whose amax is the
  whole tensor's (an all-reduce). Under ZeRO 2/3 FSDP2 all-gathers the weights in FP8
  (``enable_fsdp_float8_all_gather``), their scales the whole weight's: ``refresh_scales`` runs
  torchao's ``precompute_float8_dynamic_scale_for_fsdp`` before every step (one all-reduce of the
  amaxes; also right after a resume). Under cp each rank holds part of every sequence: the casts of
  the input and of the output gradient take their amax over the cp group (:class:`Fp8Linear`; under
  tp as well, the DTensor's amax, already whole over tp, then over cp: :func:`_amax`).
  The MoE experts' GEMMs (:class:`ExpertMatmul`) under cp at ep=1 take the same cp amaxes. Under
  ep an expert receives the rows of every ep rank's micro-batch; model/moe.py runs its FP8 GEMMs
  once per micro-batch (per sending rank; the cp ranks of one micro-batch together), so that every
  scale spanning tokens (any recipe's weight-gradient casts, tensorwise's input and output-gradient
  ones) covers one micro-batch, as one process's does.
- rowwise: a scale per row of each GEMM operand (torchao's "rowwise" recipe, power-of-2 scales);
  the weight and activations are gathered in the base precision under FSDP. Under tp the casts run
  on DTensors: a row split over the tp ranks (row-parallel inputs, column-parallel output gradients
  and weights) gets its amax over the whole row (DTensor reduces the max: the scale is Replicate).
  Under cp the weight gradient's operands, scaled per column along the tokens, take their amax over
  the cp group (:class:`_TokenScaledMatmul`; under tp too); the other casts scale along K or N, which
  no cp rank splits.
- blockwise: 1x128 tiles of activations and output gradients, 128x128 blocks of weights, all e4m3
  (DeepSeek-V3 §3.3). torchao 0.18's blockwise trainer needs triton kernels (CUDA only), so this is
  an emulation (:class:`_BlockwiseMatmul`): the same quantise-dequantise, matmuls in the base dtype.
  A K or N that 128 does not divide (MLA's kv_a: N = 512 + 64) ends in a partial tile / block with
  its own scale. Under tp the linears keep DTensor's plain styles and run the emulation on each
  rank's shards (:func:`tp_blockwise`), whose sharded sizes are multiples of 128 (resolve/fp8.py):
  a rank's tiles are one process's.

On CPU everything runs emulated (torchao's ``emulate=True``: FP8 values, higher-precision matmuls;
an fp64 model's in fp64, :func:`_emulate_in_operand_precision`: the layout tests' reference).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from paralayer.model.norms import wide
from paralayer.resolve.fp8 import BLOCK, cache_tile


def _import_quietly() -> None:
    """Import torchao without its CPU-build noise on every rank's console: a warning per CUDA-only
    library it cannot load, one from torch's pytree about its enums."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


_import_quietly()

from torchao.float8 import Float8LinearConfig, float8_utils  # noqa: E402
from torchao.float8.config import ScalingGranularity, ScalingType  # noqa: E402
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8  # noqa: E402
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args  # noqa: E402
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8  # noqa: E402

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _emulate_in_operand_precision() -> None:
    """torchao's emulated GEMM (``emulate=True``: CPU) dequantises and multiplies in fp32 whatever the
    operands' high precision. An fp64 model (the FP8 layout tests' reference precision) gets its
    emulated GEMMs in fp64 instead, so that no fp32 sum, whose order every layout changes, reaches the
    next cast's rounding; fp32 and bf16 operands keep torchao's own path. Registered once, in
    torchao's op table (its extension point: ``float8_ops.implements``)."""
    from torchao.float8 import float8_ops as ops

    aten = torch.ops.aten
    table = ops.FLOAT8_OPS_TABLE
    if getattr(table[aten.mm.default], "_paralayer", False):
        return
    torchao_mm, torchao_addmm = table[aten.mm.default], table[aten.addmm.default]

    def fp64_mm(a, b):
        """a @ b dequantised in fp64, or None where torchao's own path applies."""
        if a._orig_dtype != torch.float64 or not ops.choose_scaled_mm_config(
                a._gemm_input_role, a._linear_mm_config, b._gemm_input_role, b._linear_mm_config).emulate:
            return None
        return torch.mm(a._data.double() / a._scale.double(), b._data.double() / b._scale.double())

    def mm(aten_op, args, kwargs=None):
        out = fp64_mm(args[0], args[1])
        return torchao_mm(aten_op, args, kwargs) if out is None else out

    def addmm(aten_op, args, kwargs=None):
        out = fp64_mm(args[1], args[2])
        return torchao_addmm(aten_op, args, kwargs) if out is None else out + args[0]

    mm._paralayer = addmm._paralayer = True
    for op in (aten.mm.default, aten.matmul.default):
        table[op] = mm
    table[aten.addmm.default] = addmm


_emulate_in_operand_precision()


def recipe_config(recipe: str, emulate: bool, fsdp_float8_all_gather: bool = False) -> Float8LinearConfig:
    """torchao's Float8LinearConfig of a recipe (tensorwise | rowwise); emulated on CPU."""
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather and recipe == "tensorwise")


# ------------------------------------------------------------------ tensorwise / rowwise (torchao)
def _amax(t: torch.Tensor, mesh, granularity, axis) -> torch.Tensor:
    """``t``'s amax (whole, or along ``axis``), then its MAX over ``mesh`` (the cp ranks). Under tp
    ``t`` is a DTensor, whose amax DTensor reduces over tp; the cp reduce takes its local part and
    keeps its placements (a MAX of MAXes), which torchao's own reduce cannot (no DTensor rule)."""
    if t.numel() == 0 and mesh is not None and not isinstance(t, DTensor):
        # an expert no token of this cp rank reached: it joins its peers' reduce with amax 0
        shape = list(t.shape)
        if granularity is ScalingGranularity.AXISWISE:
            shape[axis] = 1
        amax = t.new_zeros(shape if granularity is ScalingGranularity.AXISWISE else ())
    else:
        amax = float8_utils.tensor_to_amax(t, False, None, granularity, axis)  # through the module: tests patch it
    if mesh is None:
        return amax
    local = amax.to_local() if isinstance(amax, DTensor) else amax
    local = funcol.all_reduce(local, "MAX", mesh.get_group())
    if isinstance(local, funcol.AsyncCollectiveTensor):
        local = local.wait()
    if isinstance(amax, DTensor):
        return DTensor.from_local(local, amax.device_mesh, amax.placements, run_check=False)
    return local


@torch.no_grad()
def _scale(t: torch.Tensor, dtype: torch.dtype, mesh, granularity=ScalingGranularity.TENSORWISE, axis=None,
           power_of_2: bool = False) -> torch.Tensor:
    """torchao's ``tensor_to_scale`` with the amax of :func:`_amax`."""
    return float8_utils.amax_to_scale(_amax(t, mesh, granularity, axis), dtype,
                                      round_scales_to_power_of_2=power_of_2)


class _GradCast(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient cast to FP8 with its amax over ``mesh``
    (tensorwise: the whole gradient of a sequence held by the cp ranks)."""

    @staticmethod
    def forward(ctx, y, mm_config, dtype, mesh):
        ctx.mm_config, ctx.dtype, ctx.mesh = mm_config, dtype, mesh
        return y

    @staticmethod
    def backward(ctx, g):
        if tensor_already_casted_to_fp8(g):
            return g, None, None, None
        scale = _scale(g, ctx.dtype, ctx.mesh)
        return hp_tensor_and_scale_to_float8(g, scale, ctx.dtype, ctx.mm_config, GemmInputRole.GRAD_OUTPUT), \
            None, None, None


def _cast(t: torch.Tensor, cast, axis: int, role: GemmInputRole, mm_config, config, mesh=None) -> torch.Tensor:
    """``t`` cast as ``cast`` (a CastConfig) says, its amax (per tensor, or along ``axis``) reduced
    (MAX) over ``mesh`` when given; left in high precision when the cast is disabled."""
    if tensor_already_casted_to_fp8(t) or cast.scaling_type is ScalingType.DISABLED:
        return t
    dim = get_maybe_axiswise_dim(axis, cast.scaling_granularity)
    scale = _scale(t, cast.target_dtype, mesh, cast.scaling_granularity, dim, config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm_config, role, dim)


def wgrad_mesh(mesh):
    """The mesh the weight-gradient casts reduce their amax over (the cp mesh); a seam for the
    tests' planted error (None: each cp rank's own tokens)."""
    return mesh


class _TokenScaledMatmul(torch.autograd.Function):
    """torchao's ``matmul_with_hp_or_float8_args`` (same forward, same casts), but the weight
    gradient's operands, whose axiswise scales run along the tokens (rowwise: one per column of the
    output gradient and of the input), take their amax over ``mesh``: the cp ranks' tokens together,
    so each rank casts its shard with one process's scale of the whole sequence."""

    @staticmethod
    def forward(ctx, x, w_t, mm_config, config, mesh):
        ctx.mesh = mesh
        return matmul_with_hp_or_float8_args.forward(ctx, x, w_t, mm_config, config)

    @staticmethod
    def backward(ctx, g):
        x, w_t = ctx.saved_tensors
        c, mmc, mesh = ctx.config, ctx.linear_mm_config, wgrad_mesh(ctx.mesh)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        # grad_input: scales along N (per token) and of the weight: no token crosses a cp rank
        gi = torch.mm(_cast(g2, c.cast_config_grad_output, -1, GemmInputRole.GRAD_OUTPUT, mmc, c),
                      _cast(w_t, c.cast_config_weight_for_grad_input, -1, GemmInputRole.WEIGHT, mmc, c).t())
        # grad_weight: scales along the tokens (dim 0), over every cp rank's
        gw = torch.mm(_cast(g2, c.cast_config_grad_output_for_grad_weight, 0, GemmInputRole.GRAD_OUTPUT, mmc, c,
                            mesh).t(),
                      _cast(x2, c.cast_config_input_for_grad_weight, 0, GemmInputRole.INPUT, mmc, c, mesh))
        return gi.reshape(*g.shape[:-1], gi.shape[-1]), gw.t(), None, None, None


#: The autocast whose cast torchao's ``Float8Linear.forward`` duplicates for F.linear: its
#: ``torch.is_autocast_enabled()`` and ``torch.get_autocast_gpu_dtype()``, which with no device
#: mean CUDA's (whatever the input's device).
TORCHAO_AUTOCAST = "cuda"


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 GEMM takes it under autocast, so that it saves and returns the autocast dtype
    as F.linear would: torchao's cast (CUDA's autocast dtype while CUDA's autocast is on), and, where
    torchao casts nothing, the same cast under the input's own device's autocast (a CPU bf16 run:
    ``--rehearse`` of a GPU plan, the CPU tests). :class:`Fp8Linear` applies it on every path, the
    cp ones included, which bypass torchao's forward."""
    if torch.is_autocast_enabled(TORCHAO_AUTOCAST):
        return x.to(torch.get_autocast_dtype(TORCHAO_AUTOCAST))
    dev = x.device.type
    if dev != TORCHAO_AUTOCAST and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class Fp8Linear(Float8Linear):
    """torchao's Float8Linear, plus ``token_mesh``: under cp every scale that spans tokens is taken
    over every cp rank's tokens, so it equals one process's scale of the whole sequence (tensorwise:
    the input's and output gradient's; rowwise: the weight gradient's operands, per column)."""

    token_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        if self.token_mesh is None:
            return super().forward(x)
        return _token_scaled_mm(x, self.weight.t(), self.linear_mm_config, self.config, self.token_mesh)


def _token_scaled_mm(x: torch.Tensor, w_t: torch.Tensor, mm_config, c: Float8LinearConfig, mesh) -> torch.Tensor:
    """``x @ w_t`` with torchao's casts, each scale that spans tokens taken over ``mesh`` (the cp
    ranks): rowwise the weight gradient's operands, tensorwise the input and the output gradient."""
    if c.cast_config_input_for_grad_weight.scaling_granularity is ScalingGranularity.AXISWISE:
        return _TokenScaledMatmul.apply(x, w_t, mm_config, c, mesh)
    x = _cast(x, c.cast_config_input, -1, GemmInputRole.INPUT, mm_config, c, mesh)
    y = matmul_with_hp_or_float8_args.apply(x, w_t, mm_config, c)
    return _GradCast.apply(y, mm_config, c.cast_config_grad_output.target_dtype, mesh)


class ExpertMatmul:
    """``rows @ w.t()`` for an expert's (out, in) weight slice, with the casts of a Float8Linear of
    the same recipe (model/moe.py calls it per local expert; the scale of ``w`` is that expert's).
    ``token_mesh`` (cp at ep=1): an expert's rows on a cp rank are its tokens of part of every
    sequence, so the scales that span tokens are taken over the cp group, as :class:`Fp8Linear`'s
    (model/moe.py then runs every expert on every cp rank, rows or none: the reduces must pair)."""

    def __init__(self, config: Float8LinearConfig, token_mesh=None):
        self.config, self.token_mesh = config, token_mesh
        self.mm_config = Fp8Linear(1, 1, bias=False, config=config, device="meta").linear_mm_config

    def __call__(self, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.token_mesh is not None:
            return _token_scaled_mm(rows, w.t(), self.mm_config, self.config, self.token_mesh)
        return matmul_with_hp_or_float8_args.apply(rows, w.t(), self.mm_config, self.config)


# ------------------------------------------------------------------ blockwise (emulated)
def qdq_tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Quantise-dequantise a 2-D tensor in e4m3 with one scale per (rows x cols) tile (448 / amax).
    A dimension that the tile does not divide ends in a partial tile scaled by its own elements'
    amax (DeepSeek's kernels' ceil-div scale grid): zero-padded to whole tiles (zeros leave every
    amax as it was), then cropped."""
    m, k = x.shape
    pm, pk = -m % rows, -k % cols
    t = nn.functional.pad(x, (0, pk, 0, pm)) if pm or pk else x
    t = t.reshape((m + pm) // rows, rows, (k + pk) // cols, cols)
    amax = wide(t.abs().amax(dim=(1, 3), keepdim=True)).clamp(min=1e-12)
    scale = E4M3_MAX / amax
    q = (wide(t) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = (q.to(scale.dtype) / scale).to(x.dtype).reshape(m + pm, k + pk)
    return out[:m, :k] if pm or pk else out


class _BlockwiseMatmul(torch.autograd.Function):
    """y = x @ wᵀ, DeepSeek-V3's fine-grained FP8: forward x in 1x128 tiles, w in 128x128 blocks;
    dgrad: dy in 1x128 tiles (along N) times the same w blocks; wgrad: dyᵀ in 1x128 tiles and x in
    128x1 tiles, both along the tokens (so seq_len must hold whole tiles: resolve/fp8.py). A K, N
    or token count that 128 does not divide ends in a partial tile or block (:func:`qdq_tiles`)."""

    @staticmethod
    def forward(ctx, x, w):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = qdq_tiles(x2, 1, BLOCK) @ qdq_tiles(w, BLOCK, BLOCK).t()
        ctx.save_for_backward(x, w)
        return y.reshape(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        m = x.numel() // x.shape[-1]
        x2, g2 = x.reshape(m, -1), g.reshape(m, -1)
        gx = qdq_tiles(g2, 1, BLOCK) @ qdq_tiles(w, BLOCK, BLOCK)
        gw = qdq_tiles(g2.t().contiguous(), 1, BLOCK) @ qdq_tiles(x2, BLOCK, 1)
        return gx.reshape(x.shape), gw.to(w.dtype)


def blockwise_mm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows @ wᵀ in the emulated blockwise recipe (the MoE experts' GEMMs, plain tensors)."""
    return _BlockwiseMatmul.apply(rows, w)


def _tp_layouts(kind: str, nd: int) -> tuple:
    """(input, output, input gradient, output gradient) placements over tp of a blockwise GEMM on
    ``nd``-D activations, by how its weight is split: ``colwise`` (Shard(0)): the whole input in,
    this rank's N columns out, the input gradient a partial sum over the ranks' N columns;
    ``rowwise`` (Shard(1)): this rank's K columns in, a partial sum out, its K columns of the input
    gradient; ``replicate`` (MLA's q_a, kv_a): whole everywhere, the output gradient (a partial
    sum: each rank's heads give part of it) summed before it is tiled, as one process tiles the
    whole gradient. None: DTensor.from_local's default (a sharded output's gradient sharded alike,
    a partial output's whole)."""
    last = Shard(nd - 1)
    return {"colwise": (Replicate(), last, Partial(), None), "rowwise": (last, Partial(), last, None),
            "replicate": (Replicate(), Replicate(), Replicate(), Replicate())}[kind]


def tp_blockwise(x: torch.Tensor, w: DTensor) -> DTensor:
    """The blockwise GEMM of a tp-split linear (DTensor weight on the 1-D tp mesh) on local shards:
    every sharded K or N is a multiple of 128 on a rank (resolve/fp8.py), so a rank's tiles and
    blocks are exactly one process's, and the matmul of :class:`_BlockwiseMatmul` runs on them as
    it is; the DTensor placements carry the reductions (a row-parallel output, a column-parallel
    input gradient) that the tp styles' hooks then perform."""
    mesh, (wp,) = w.device_mesh, w.placements
    kind = "replicate" if wp.is_replicate() else "colwise" if wp.is_shard(0) else "rowwise"
    xin, out, gin, gout = _tp_layouts(kind, x.ndim)
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [xin], run_check=False)
    elif x.placements != (xin,):
        x = x.redistribute(mesh, [xin])
    y = _BlockwiseMatmul.apply(x.to_local(grad_placements=[gin]), w.to_local())
    return DTensor.from_local(y, mesh, [out], run_check=False, grad_placements=None if gout is None else [gout])


class BlockwiseFp8Linear(nn.Linear):
    """nn.Linear whose GEMMs run the emulated blockwise recipe (no bias: the blocks have none);
    under tp (a DTensor weight) on each rank's shards (:func:`tp_blockwise`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return tp_blockwise(x, self.weight)
        return _BlockwiseMatmul.apply(x, self.weight)

    @classmethod
    def from_float(cls, mod: nn.Linear) -> "BlockwiseFp8Linear":
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        return new


# ------------------------------------------------------------------ the conversion
def tp_styles(recipe: str, fp8_comm: bool) -> dict:
    """The tensor-parallel styles of an FP8 block: torchao's float8 ones for tensorwise where the
    backend moves FP8 tensors (NCCL: the SP all-gather in FP8), the plain ones otherwise (gloo has
    no float8 dtype; the linear then casts the gathered input with the same whole-tensor scale)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    if recipe == "tensorwise" and fp8_comm:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel,
                "prepare": PrepareFloat8ModuleInput}
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "prepare": PrepareModuleInput}


def convert_blocks(chunk: nn.Module, recipe: str, layers: list[int], *, emulate: bool,
                   fsdp_float8_all_gather: bool = False, token_mesh=None, fp8_comm: bool = True,
                   expert_token_mesh=None) -> int:
    """Swap the GEMMs of ``chunk``'s blocks whose global index is in ``layers`` to FP8, in place, on
    the meta model (before tp, FSDP and materialisation). Returns the number of linears swapped.
    ``token_mesh``: the cp mesh (tensorwise scales over every cp rank's tokens); ``fp8_comm``: the
    tp collectives may carry FP8 (NCCL; not gloo); ``expert_token_mesh``: the cp mesh for the MoE
    experts' casts (ep=1; under ep an expert's rows come per sender, model/moe.py)."""
    config = None if recipe == "blockwise" else recipe_config(recipe, emulate, fsdp_float8_all_gather)
    wanted = set(layers)
    swapped = 0
    for block in chunk.layers.values():
        if block.layer_id not in wanted:
            continue
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or name == "gate":  # the router stays in base precision
                    continue
                if config is None:
                    new = BlockwiseFp8Linear.from_float(child)
                else:
                    new = Fp8Linear.from_float(child, config=config)
                    new.token_mesh = token_mesh
                setattr(parent, name, new)
                swapped += 1
        ff = block.feed_forward
        if hasattr(ff, "expert_mm"):  # MoE: the experts' hand-written GEMMs
            ff.expert_mm = blockwise_mm if config is None else ExpertMatmul(config, expert_token_mesh)
        # every recipe takes its linears' own tp hooks (blockwise: DTensor's plain styles, never the
        # fused SP GEMMs, which would multiply the weights in the base precision)
        block.fp8_tp_styles = tp_styles(recipe, fp8_comm)
    return swapped


def refresh_scales(chunks: list[nn.Module]) -> None:
    """FSDP's FP8 all-gather: every weight's scale from its whole tensor (one all-reduce), before a
    step's forward (torchtitan runs it after the optimizer step; before the forward also covers the
    first step and a resume). A no-op without FP8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for chunk in chunks:
        if getattr(chunk, "fp8_fsdp_all_gather", False):
            precompute_float8_dynamic_scale_for_fsdp(chunk)


# ------------------------------------------------------------------ activations cached in FP8
# train.fp8.cache_activations (DeepSeek-V3, arXiv 2412.19437 §3.3.3 "Low-Precision Activation" (2):
# "we cache the inputs of the SwiGLU operator and recompute its output in the backward pass. These
# activations are also stored in FP8 with our fine-grained quantization method"). What is cached:
# the MoE SwiGLU's inputs (each routed expert's and the shared expert's gate and up), which
# recompute swiglu / norm_up keep as the inputs of the recomputed product (model/recompute.py
# ``recompute(..., cache=)``), as e4m3 with one fp32 scale per 1x128 tile of a row (amax / 448; a
# row that 128 does not divide is one tile: resolve/fp8.py cache_tile); the rerun reads their
# dequantised values, so backward sees the FP8 values while the forward is unchanged. 1 byte per
# element plus 4 per tile (resolve/fp8.py cached_bytes, which the plan counts). Not cached: the
# inputs of the Linear after attention (wo's), which the report keeps in E5M6, a format torch has
# no dtype for.
class Fp8Tiles:
    """Pack a tensor as (e4m3 values, fp32 scale per 1xTILE tile of its last dim); unpack to its dtype."""

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = t.shape[-1]
        w = cache_tile(k) if k else 1
        tiles = t.detach().reshape(*t.shape[:-1], k // w if k else 0, w)
        amax = wide(tiles.abs().amax(dim=-1, keepdim=True)).clamp(min=1e-12) if k else wide(tiles)
        scale = E4M3_MAX / amax
        q = (wide(tiles) * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, scale

    @staticmethod
    def unpack(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (q.to(scale.dtype) / scale).to(dtype).flatten(-2)
