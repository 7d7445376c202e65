"""The model families' outside oracles, shared by tests/test_families.py: small transformers
models (LlamaForCausalLM with Llama 3.1's RoPE, Qwen3ForCausalLM with head_dim != d_model/n_heads,
Qwen3 with interleaved sliding and full layers, MistralForCausalLM with a uniform window,
Gemma3ForCausalLM with its local:global pattern, two RoPE bases and its own norms) at a wide init,
saved with their own ``save_pretrained``; and the planted errors the oracle must catch."""
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

# Gemma 3: sliding_window_pattern 3 (sliding, sliding, full, sliding: a full layer on each pp2 stage's
# side of the split is not needed, the pattern is what is read), linear RoPE ×2 on the full layers
# (Gemma 3 4B+ publish linear ×8), the sliding layers' own base, query_pre_attn_scalar 20 ≠ head_dim 24
GEMMA = dict(head_dim=24, sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=20,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 700.0}})

# GPT-OSS: 4 experts top-2 with biases, its router bias, sinks, attention biases, sliding/full
# alternating (its default pattern), head_dim 24, YaRN without truncation (as the releases), a
# SwiGLU clamp of 1.5 (the releases' 7.0 is seldom reached at this width: 1.5 makes it bite)
GPT_OSS = dict(head_dim=24, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
               rope_parameters={**YARN, "truncate": False})

FAMILIES = ("llama3", "qwen3", "window", "mistral", "gemma3", "gpt_oss")
#: which planted errors apply to which family (qk: the family has q/k norms; window: it slides)
PLANTS = {"llama3": ("rope_factor_x2",), "qwen3": ("rope_factor_x2", "qk_norm_after_rope"),
          "window": ("rope_factor_x2", "qk_norm_after_rope", "window_off_by_one"),
          "mistral": ("rope_factor_x2", "window_off_by_one"),
          "gemma3": ("rope_factor_x2", "qk_norm_after_rope", "window_off_by_one", "embed_scale_dropped",
                     "local_rope_as_global", "post_norms_dropped"),
          "gpt_oss": ("rope_factor_x2", "window_off_by_one", "sink_left_out", "yarn_truncated", "clamp_dropped")}
#: the plants that are a change of the config (the model is built after them)
CONFIG_PLANTS = ("rope_factor_x2", "window_off_by_one", "embed_scale_dropped", "local_rope_as_global",
                 "post_norms_dropped", "yarn_truncated", "clamp_dropped")
#: our family name per test family (its own weight names: names.ours_to_hf(..., family=))
HF_FAMILY = {"llama3": "llama", "qwen3": "qwen3", "window": "qwen3", "mistral": "mistral", "gemma3": "gemma3_text",
             "gpt_oss": "gpt_oss"}


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
    if family == "gemma3":
        import copy

        # pad_token_id None: transformers' embedding would freeze the pad row's gradient (padding_idx),
        # which we do not build (every row of ours trains; docs/models.md)
        return transformers.Gemma3TextConfig(**BASE, **copy.deepcopy(GEMMA), pad_token_id=None)
    if family == "gpt_oss":
        import copy

        return transformers.GptOssConfig(**BASE, **copy.deepcopy(GPT_OSS), pad_token_id=None)
    raise ValueError(family)


def attn_impl(family: str) -> str:
    """transformers' attention for the family's oracle (GptOss has no SDPA path: its eager one)."""
    return "eager" if family == "gpt_oss" else "sdpa"


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
    cfg._attn_implementation = attn_impl(family)
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
    elif kind == "embed_scale_dropped":
        mcfg.embed_scale = False
    elif kind == "local_rope_as_global":
        mcfg.rope_local_theta = None
    elif kind == "post_norms_dropped":  # the (1 + w) gains still trained, but as pre-norms only
        mcfg.post_norms = False
    elif kind == "yarn_truncated":  # the correction range floored/ceiled, as every yarn but GPT-OSS's
        mcfg.rope.truncate = True
    elif kind == "clamp_dropped":  # GPT-OSS's experts without the clamp (and so without (up + 1))
        mcfg.moe.swiglu_limit = None
    elif kind == "sink_left_out":  # the learned logits kept but out of the softmax
        for layer in model.layers.values():
            att = layer.attention
            att._planted, att.sinks = [att.sinks], None  # a list: not registered, not compared
    elif kind == "qk_norm_after_rope":
        for layer in model.layers.values():
            _qk_after_rope(layer.attention)
    else:
        raise ValueError(kind)


def _qk_after_rope(att) -> None:
    qn, kn, core = att.q_norm, att.k_norm, att.attn_fn
    att.q_norm = att.k_norm = None
    att._planted = (qn, kn)  # keep the weights registered elsewhere out of the way
    att.attn_fn = lambda q, k, v, **kw: core(qn(q), kn(k), v, **kw)


class _GradReader:
    """A checkpoint reader over transformers' gradients (checkpoint/hf_fused.py reads them as ours)."""

    def __init__(self, params: dict):
        self.params = params

    def get_rows(self, key: str, start: int, length: int):
        return self.params[key].grad[start:start + length]


def their_grad(hf_params: dict, family: str, name: str):
    """transformers' gradient of our parameter ``name`` (its fused experts split as ours)."""
    from paralayer.checkpoint import hf_fused
    from paralayer.families import family as fam_of
    from paralayer.families.names import ours_to_hf

    mod = fam_of(HF_FAMILY[family])
    fused = getattr(mod, "FUSED_EXPERTS", None)
    if fused and hf_fused.is_fused_name(name):
        return hf_fused.read_fused(_GradReader(hf_params), fused, name, 0, 1 << 30)
    return hf_params[ours_to_hf(name, family=mod.NAME)].grad

