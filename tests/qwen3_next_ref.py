"""Qwen3-Next's outside oracle, shared by its tests: a tiny Qwen3NextForCausalLM (transformers
5.25's torch fallback) at init std 0.2 (tests/families.py ``widen``), saved by its own
save_pretrained. 4 layers (linear, full, linear, full: a full and a linear layer on each side of
a pp2 split), d 64, sequences of 128 (two chunks: the state carried between them), 2 k-heads
serving 4 v-heads, 4 experts top-2 with the gated shared expert; its (1 + w) norms' gains in
[0.5, 1.5) (widen's rand + 0.5, less 1)."""
from __future__ import annotations

import torch

from tests.families import VOCAB, widen

SEQ = 128  # two chunks of the delta rule (64 tokens each, transformers' and ours)

CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6,
              max_position_embeddings=SEQ, tie_word_embeddings=False, full_attention_interval=2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, pad_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})


def save(path: str, dense: bool = False):
    """The transformers model (fp32, eval, sdpa) saved at ``path``; ``dense``: no experts."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(**{**CONFIG, **({"num_experts": 0} if dense else {})})
    cfg._attn_implementation = "sdpa"
    model = widen(transformers.Qwen3NextForCausalLM(cfg).float().eval(), 11)
    with torch.no_grad():  # its (1 + w) norms: gains in [0.5, 1.5) as widen gives the plain ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.sub_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return model
