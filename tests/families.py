"""The model families' outside oracles, shared by tests/test_families.py: small transformers
models (LlamaForCausalLM with Llama 3.1's RoPE, Qwen3ForCausalLM with head_dim != d_model/n_heads,
Qwen3 with interleaved sliding and full layers, MistralForCausalLM with a uniform window) at a
wide init, saved with their own ``save_pretrained``; and the planted errors the oracle must catch."""
from __future__ import annotations

import torch

SEQ, VOCAB, THETA = 64, 61, 5000.0
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-6, max_position_embeddings=SEQ,
            tie_word_embeddings=False)
WINDOW = 16
# every family gets a scaled RoPE, so "factor off by 2" is a planted error for each of them; positions
# run to 63, past the original 32 (llama3: the 16-dim head's wavelengths 6.3 / 53 / 444 / ... fall in
# the kept, the smoothed and the divided band)
LLAMA3 = {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": THETA, "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 32}

FAMILIES = ("llama3", "qwen3", "window", "mistral")
#: which planted errors apply to which family (qk: the family has q/k norms; window: it slides)
PLANTS = {"llama3": ("rope_factor_x2",), "qwen3": ("rope_factor_x2", "qk_norm_after_rope"),
          "window": ("rope_factor_x2", "qk_norm_after_rope", "window_off_by_one"),
          "mistral": ("rope_factor_x2", "window_off_by_one")}


def hf_config(family: str):
    import transformers

    if family == "llama3":
        return transformers.LlamaConfig(**BASE, rope_parameters=dict(LLAMA3))
    if family == "qwen3":  # head_dim 24, not 64 / 4
        return transformers.Qwen3Config(**BASE, head_dim=24, rope_parameters=dict(YARN))
    if family == "window":  # Qwen3 layer_types: sliding, full, sliding, full
        return transformers.Qwen3Config(**BASE, head_dim=24, rope_parameters=dict(LLAMA3), use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=0,
                                        layer_types=["sliding_attention", "full_attention"] * 2)
    if family == "mistral":
        return transformers.MistralConfig(**BASE, sliding_window=WINDOW, rope_parameters=dict(YARN))
    raise ValueError(family)


def widen(model, seed: int):
    """std 0.2 and norm gains in [0.5, 1.5): Hugging Face's init (0.02, gains 1) hides errors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def save_family(family: str, path: str):
    """The transformers model of ``family`` (fp32, eval, sdpa) saved by its own save_pretrained."""
    import transformers

    torch.manual_seed(0)
    cfg = hf_config(family)
    cfg._attn_implementation = "sdpa"
    model = widen(transformers.AutoModelForCausalLM.from_config(cfg).float().eval(), FAMILIES.index(family))
    model.save_pretrained(path, safe_serialization=True)
    return model


def plant(model, mcfg, kind: str) -> None:
    """Put one error into our side, in place (the model is built from ``mcfg`` after this for the
    config plants; the qk plant rewires the built model)."""
    if kind == "rope_factor_x2":
        mcfg.rope.factor *= 2
    elif kind == "window_off_by_one":
        mcfg.sliding_window += 1
    elif kind == "qk_norm_after_rope":
        for layer in model.layers.values():
            _qk_after_rope(layer.attention)
    else:
        raise ValueError(kind)


def _qk_after_rope(att) -> None:
    qn, kn, core = att.q_norm, att.k_norm, att.attn_fn
    att.q_norm = att.k_norm = None
    att._planted = (qn, kn)  # keep the weights registered elsewhere out of the way
    att.attn_fn = lambda q, k, v: core(qn(q), kn(k), v)
