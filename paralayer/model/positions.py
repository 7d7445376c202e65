"""Rotary position embeddings (RoPE): the inverse frequencies of each kind, and their rotation.

Kinds (``model.rope.type``), each computed exactly as transformers' ``modeling_rope_utils`` does,
so an imported checkpoint sees the angles it was trained with:

    default   inv_freq_i = 1 / theta^(2i/d)
    linear    the default's divided by ``factor`` (positions / factor: Gemma 3's global layers)
    llama3    Llama 3.1's smoothing: long wavelengths (> original_max_position / low_freq_factor)
              divided by ``factor``, short ones (< original / high_freq_factor) kept, the band
              between interpolated
    yarn      YaRN: interpolated and extrapolated frequencies blended by a linear ramp between the
              correction dims of beta_fast / beta_slow (truncated to whole dims unless rope.truncate is
              false), and cos/sin scaled
              by the attention factor (0.1·ln(factor)+1, or DeepSeek's mscale ratio)

Rotate-half layout (Hugging Face's): imported q/k weights need no permutation.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

# (inv_freq, attention_factor) of one RoPE kind from (head_dim, theta, rope config)
InvFreqFn = Callable[[int, float, object], tuple[torch.Tensor, float]]


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def default_inv_freq(dim: int, theta: float, rope=None) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(dim, theta), 1.0


def linear_inv_freq(dim: int, theta: float, rope) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(dim, theta) / rope.factor, 1.0


def llama3_inv_freq(dim: int, theta: float, rope) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(dim, theta)
    factor, lo, hi = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_position
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def yarn_attention_factor(rope) -> float:
    """cos/sin scale of YaRN: given, or DeepSeek's mscale ratio, or 0.1·ln(factor) + 1."""
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim))
    return get_mscale(rope.factor)


def yarn_inv_freq(dim: int, theta: float, rope) -> tuple[torch.Tensor, float]:
    factor, old = rope.factor, rope.original_max_position

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if getattr(rope, "truncate", True):  # transformers' truncate (default true; GPT-OSS: false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, yarn_attention_factor(rope)


ROPE_KINDS: dict[str, InvFreqFn] = {"default": default_inv_freq, "linear": linear_inv_freq,
                                    "llama3": llama3_inv_freq, "yarn": yarn_inv_freq}


def inv_freq_for(head_dim: int, theta: float, rope=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,), cos/sin scale) of the configured RoPE kind."""
    kind = getattr(rope, "type", "default") if rope is not None else "default"
    return ROPE_KINDS[kind](head_dim, theta, rope)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rope: Optional[object] = None):
    """cos/sin for the given positions (s,) or (b, s): rotate-half layout, shape (..., s, head_dim)."""
    inv_freq, scale = inv_freq_for(head_dim, theta, rope)
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, d); cos/sin: (s, r) or (b, s, r). r < d (partial RoPE, Qwen3-Next's
    partial_rotary_factor): the first r dims turn, the rest pass as they are."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    if r < x.shape[-1]:
        turned = x[..., :r] * cos + _rotate_half(x[..., :r]) * sin
        return torch.cat([turned, x[..., r:]], dim=-1)
    return x * cos + _rotate_half(x) * sin
