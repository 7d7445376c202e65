"""The decoder every layout starts from: embedding, the blocks (paralayer/model/block.py, built
from the parts: positions, norms, attention, mlp, moe), the final norm and the head.

Built on the meta device, split and sharded by ``paralayer.parallel``, then materialised by
:func:`init_weights`, which draws each parameter's FULL tensor from (seed, parameter name) and
keeps the local slice: one seed gives the same full weights under any layout. Names follow the
Hugging Face Llama layout closely enough for a direct mapping (``paralayer.checkpoint.hf``); RoPE uses the
same rotate-half convention so imported weights need no permutation.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from paralayer.config import ModelConfig
from paralayer.config.layer_pattern import layer_types
from paralayer.model.attention import head_dim_of, window_bias
from paralayer.model.block import TransformerBlock, is_moe_layer
from paralayer.model.mtp import MultiTokenPrediction
from paralayer.model.norms import make_norm, wide
from paralayer.model.positions import rope_cos_sin


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocab rounded up to a multiple of tp (the padding rows never count in the loss)."""
    return int(math.ceil(vocab_size / tp) * tp)


class Transformer(nn.Module):
    """Decoder-only LM. A pipeline stage is the same class with some parts set to None."""

    def __init__(self, cfg: ModelConfig, vocab_padded: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.vocab_padded = vocab_padded or cfg.vocab_size
        # An explicit (uninitialised) weight skips nn.Embedding's normal_ init: on the meta device
        # that init pulls in torch._dynamo (~2 s per rank), and init_weights overwrites it anyway.
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(
            self.vocab_padded, cfg.d_model, _weight=torch.empty(self.vocab_padded, cfg.d_model))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: Optional[nn.RMSNorm] = make_norm(cfg.d_model, cfg.norm_eps, cfg.norm_offset)
        self.output: Optional[nn.Linear] = nn.Linear(cfg.d_model, self.vocab_padded, bias=False)
        # the dims RoPE rotates: a head's, or MLA's decoupled rope part
        # (model.rotary_fraction: RoPE on the first part of each head only, Qwen3-Next)
        self.head_dim = (cfg.mla.qk_rope_head_dim if cfg.mla.kv_lora_rank > 0
                         else int(head_dim_of(cfg) * cfg.rotary_fraction))
        # Global positions of the local tokens (set under context parallel: zigzag chunks).
        self.positions: Optional[torch.Tensor] = None
        # Gemma 3: the sliding layers' own RoPE base (a plain RoPE), the full layers' is model.rope
        self.local_rope = cfg.rope_local_theta is not None and "sliding" in layer_types(cfg)
        self.sliding = [t == "sliding" for t in layer_types(cfg)]
        # multi-token prediction (model/mtp.py): run in the loss from what the forward leaves here
        self.mtp: Optional[MultiTokenPrediction] = (
            MultiTokenPrediction(cfg, self.vocab_padded) if cfg.mtp.depth > 0 else None)
        self.mtp_input: Optional[tuple] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) on the first stage, hidden (b, s, d) elsewhere → logits or hidden."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
            if self.cfg.embed_scale:  # Gemma: × sqrt(d_model), the factor rounded to the weight's dtype
                h = h * embed_scale(self.cfg.d_model, self.tok_embeddings.weight.dtype)
        s = h.shape[1]
        pos = self.positions.to(h.device) if self.positions is not None else torch.arange(s, device=h.device)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.cfg.rope_theta, h.dtype, self.cfg.rope)
        local = rope_cos_sin(pos, self.head_dim, self.cfg.rope_local_theta, h.dtype) if self.local_rope else None
        masks: dict = {}  # window -> the chunk's one mask, shared by its windowed layers (attention.window_bias)
        for name, layer in self.layers.items():
            w = getattr(layer.attention, "shared_mask_window", None)
            if w is not None and w not in masks:
                dev = h.device.type
                dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
                masks[w] = window_bias(pos.shape[0], w, h.device, dtype)  # the full sequence under SP
            args = local if local is not None and self.sliding[int(name)] else (cos, sin)
            h = layer(h, *args) if w is None else layer(h, *args, masks[w])
        if self.norm is not None:
            h = self.norm(h)
        if self.mtp is not None and self.output is not None and self.mtp.count_stats:
            self.mtp_input = (h, cos, sin)
        if self.output is not None:
            h = self.output(h)
        return h

    def mtp_outputs(self, labels: torch.Tensor) -> list:
        """[(logits, targets)] of each MTP depth, from the last forward's final hidden (model/mtp.py)."""
        h0, cos, sin = self.mtp_input
        self.mtp_input = None
        emb = self.mtp.embed if self.mtp.embed is not None else self.tok_embeddings
        return self.mtp(h0, labels, cos, sin, emb, self.output)

    def aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the MoE layers' load-balancing losses from the last forward (None if dense)."""
        total = None
        for layer in self.layers.values():
            ff = layer.feed_forward
            a = getattr(ff, "aux_loss", None)
            if a is not None:
                total = a if total is None else total + a
        return total

    def seq_aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the MoE layers' sequence-wise balance losses (None when off or dense)."""
        total = None
        for layer in self.layers.values():
            a = getattr(layer.feed_forward, "seq_aux_loss", None)
            if a is not None:
                total = a if total is None else total + a
        return total


def embed_scale(d_model: int, dtype: torch.dtype) -> float:
    """Gemma's embedding factor sqrt(d_model) as its embedding's dtype holds it (transformers casts the
    factor to the weight's dtype: 73.32 is 73.5 in bf16 at d_model 5376), as a Python number so that
    it multiplies a DTensor as well as a tensor."""
    return float(torch.tensor(d_model ** 0.5).to(dtype))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (fp64 logits stay fp64); padded vocab columns are masked out."""
    logits = wide(logits)
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


# ------------------------------------------------------------------ layout-independent init
def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_init(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter, from its name alone."""
    if cfg.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # one matrix, two copies (paralayer/parallel/tied_embeddings.py)
    if name == "mtp.embed.weight":
        name = "tok_embeddings.weight"  # the last stage's copy of the embedding (model/mtp.py)
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "dt_bias" or name.endswith("attention.norm.weight"):  # Gated DeltaNet: 1 (its norm's gain is w)
        return torch.ones(shape)
    if leaf == "A_log":  # Gated DeltaNet's decay rates A in [1, 16], as transformers draws them
        g = torch.Generator().manual_seed(_seed_for(seed, name))
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith("norm.weight"):  # gain 1: w = 1, or w = 0 for Gemma's (1 + w)
        return torch.zeros(shape) if cfg.norm_offset else torch.ones(shape)
    if leaf in ("bias", "b1", "b2", "b3"):  # GPT-OSS's biases start at 0 (its sinks: normal, as weights)
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(_seed_for(seed, name))
    std = cfg.init_std
    if parent in ("wo", "w2") or leaf == "w2":
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    if parent in ("tok_embeddings",) and not cfg.tie_embeddings:
        std = 1.0  # tied, it is also the head: init_std like Megatron's shared embedding
    return torch.empty(shape).normal_(0.0, std, generator=g)


def _logical_shape(model: Transformer, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if name.startswith("tok_embeddings.") or name.startswith("output."):
        return (model.vocab_size,) + tuple(shape[1:])
    return shape


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> None:
    """Materialise every parameter: full tensor from (seed, name), then this rank's slice.

    Works for plain tensors, DTensors (TP / FSDP shards, sliced locally without communication)
    and modules that hold a slice of a dimension (``local_slices``: experts under EP).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    root = model
    vocab = getattr(model, "vocab_size", cfg.vocab_size)
    owners = {}
    for mod_name, mod in model.named_modules():
        for p_name in getattr(mod, "local_slices", {}) or {}:
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = (mod, p_name)
    for name, param in model.named_parameters():
        clean = _clean_name(name)
        global_shape = tuple(param.shape)  # DTensor .shape is the global shape
        if clean in owners:
            mod, p_name = owners[clean]
            dim, offset, full_len = mod.local_slices[p_name]
            shp = list(global_shape)
            shp[dim] = full_len
            global_shape = tuple(shp)
        logical = list(global_shape)
        if clean.startswith(("tok_embeddings.", "output.", "mtp.embed.")):
            logical[0] = vocab
        full = full_init(clean, tuple(logical), cfg, seed)
        if tuple(logical) != global_shape and clean not in owners:
            pad = torch.zeros(global_shape)
            pad[: logical[0]] = full
            full = pad
        if clean in owners:
            mod, p_name = owners[clean]
            dim, offset, _ = mod.local_slices[p_name]
            local_len = param.shape[dim]  # a DTensor's shape is this ep rank's expert count
            full = full.narrow(dim, offset, local_len).contiguous()
        full = full.to(device=device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    del root


def _clean_name(name: str) -> str:
    """Parameter name without wrapper prefixes (checkpoint, compile, FSDP)."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


def count_matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (embedding lookup excluded)."""
    h, f = cfg.d_model, cfg.ffn_hidden
    hd = head_dim_of(cfg)
    attn = h * hd * (cfg.n_heads * 2 + cfg.n_kv_heads * 2)
    dense_mlp = 3 * h * f
    total = 0
    for i in range(cfg.n_layers):
        total += attn
        if is_moe_layer(cfg, i):
            m = cfg.moe
            total += m.top_k * 3 * h * (m.ffn_hidden or f) + h * m.num_experts + 3 * h * m.shared_ffn_hidden
        else:
            total += dense_mlp
    return total + h * cfg.vocab_size
