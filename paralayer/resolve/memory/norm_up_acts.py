"""What recompute=norm_up (DeepSeek-V3's, arXiv 2412.19437 §3.2.3) no longer keeps for backward,
per token of one layer, in units of ``ACT_BYTES[precision]``: its saved set is recompute=none's
(swiglu's in an MoE block: the experts' SwiGLU output is recomputed too) less this.

Measured on model/block.py and model/latent_attention.py with the block harness
(tests/test_block_activations.py, one storage counted once) at DeepSeek-V3's widths on a GPU
layout's fake tensors and at deepseek-v3-tiny's on real CPU tensors, fp32 and bf16:

    every norm's 1/rms (fp32: 2 units under bf16)     the two block norms, and MLA's q and kv
                                                      latent norms
    the block norms' outputs                          2h (under autocast they are fp32 and never
                                                      kept: their consumers keep bf16 casts, which
                                                      stay, outside the rebuilt region)
    MLA: the latent norms' outputs (q_b's and         q_lora + kv_lora (their bf16 casts under
         kv_b's inputs)                               autocast, made inside the region)
    MLA: the core's q and k, and kv_b's output        2a·d_qk + a·(nope + d_v) where the kernel
         (v is a view of it)                          saves its inputs as given: a GPU kernel, CPU
                                                      flash (d_qk = d_v) in fp32 and under FSDP's
                                                      bf16; CPU flash under autocast keeps its own
                                                      casts of q and k (fp32 after RoPE): a·(nope +
                                                      d_v); CPU SDPA's math path (d_qk ≠ d_v)
                                                      copies all three: nothing

(h d_model, a heads, d_qk = nope + rope.) The final norm and the MTP depths' norms are not rebuilt
(model/transformer.py, model/mtp.py): once per stage, counted by head_saved_elems and
mtp_saved_elems as before.
"""
from __future__ import annotations

from paralayer.config import Config
from paralayer.resolve import model_parts as parts
from paralayer.resolve.memory.states import precision_mode
from paralayer.resolve.rules import Layout


def norm_up_freed(cfg: Config, lay: Layout) -> float:
    """The saved elements per token recompute=norm_up frees in one block (module docstring)."""
    m = cfg.model
    h, a = m.d_model, m.n_heads
    mode = precision_mode(lay.precision, lay.zero, lay.dp * lay.cp)
    autocast = mode == "bf16-autocast"
    rstd = 2.0 if lay.precision == "bf16" else 1.0  # 1/rms is fp32
    norms = 2
    freed = 0.0 if autocast else 2.0 * h
    if parts.attention_kind(cfg) == "mla":
        ml = m.mla
        ql = ml.q_lora_rank or 0
        norms += 2 if ql else 1
        freed += ql + ml.kv_lora_rank
        dqk, dv = parts.qk_head_dim(cfg), parts.v_head_dim(cfg)
        kv_out = a * (ml.qk_nope_head_dim + dv)
        if lay.device != "cpu":
            freed += 2 * a * dqk + kv_out
        elif dqk == dv:
            freed += kv_out if autocast else 2 * a * dqk + kv_out
    return freed + norms * rstd
