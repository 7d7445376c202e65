"""The RoPE of a Hugging Face config.json → ``model.rope_theta`` and ``model.rope`` fields, and back
(:func:`rope_parameters`, for export); shared by every family, torch-free.

Both spellings: ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5, which
also holds rope_theta). The kinds we build exactly: default, linear, llama3, yarn. Anything else — another
rope type, a per-layer-type (nested) rope, a partial rotary factor, a key
a kind does not take — is refused with the key, the value and what we support: an approximated
RoPE trains a different model."""
from __future__ import annotations

import json
import math
from typing import Any

from paralayer.families.errors import HFFormatError

SUPPORTED = ("default", "linear", "llama3", "yarn")
# the keys each kind takes (besides rope_type/type and rope_theta); transformers' own validation lists
_KEYS = {"default": set(), "linear": {"factor"},
         "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
         "yarn": {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                  "original_max_position_embeddings", "truncate"}}
_OURS = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
         "original_max_position_embeddings": "original_max_position", "beta_fast": "beta_fast",
         "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
         "attention_factor": "attention_factor"}


def _err(fp: str, msg: str) -> HFFormatError:
    return HFFormatError(f"{fp}: {msg}")


def _num(d: dict, key: str, where: str, fp: str) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _err(fp, f"'{where}.{key}' must be a positive number, got {json.dumps(v)[:40]}")
    return float(v)


def _params(hf: dict, fp: str) -> tuple[str, dict]:
    """(which key, the rope dict): rope_parameters when it says more than the theta, else rope_scaling."""
    rp, rs = hf.get("rope_parameters"), hf.get("rope_scaling")
    for key, val in (("rope_parameters", rp), ("rope_scaling", rs)):
        if val is not None and not isinstance(val, dict):
            raise _err(fp, f"'{key}' must be an object (or null), got {json.dumps(val)[:40]}")
    rp, rs = rp or {}, rs or {}
    nested = [k for k, v in rp.items() if isinstance(v, dict)]
    if nested:
        raise _err(fp, f"rope_parameters per layer type ({', '.join(sorted(nested))}) is not supported "
                       "(one RoPE for every layer)")
    if rs and not (set(rp) - {"rope_theta"}):
        return "rope_scaling", {**rs, **({"rope_theta": rp["rope_theta"]} if "rope_theta" in rp else {})}
    return "rope_parameters", rp


def read_rope(hf: dict, fp: str) -> tuple[float, dict]:
    """(rope_theta, RopeConfig fields) of config.json ``hf``; raises HFFormatError naming the key."""
    where, rp = _params(hf, fp)
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in SUPPORTED:
        raise _err(fp, f"{where}.rope_type={json.dumps(rtype)[:40]} is not supported ({', '.join(SUPPORTED)})")
    theta_src = rp if "rope_theta" in rp else hf
    theta = theta_src.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise _err(fp, f"'rope_theta' must be > 0, got {json.dumps(theta)[:40]}")
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise _err(fp, f"partial_rotary_factor={json.dumps(prf)[:40]} is not supported (1.0: RoPE on the whole head)")
    extra = set(rp) - _KEYS[rtype] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra = {k for k in extra if rp[k] is not None}
    if extra:
        k = sorted(extra)[0]
        raise _err(fp, f"{where}.{k}={json.dumps(rp[k])[:40]} is not supported with rope_type {rtype} "
                       f"(its keys: {', '.join(sorted(_KEYS[rtype])) or 'none'})")
    out: dict[str, Any] = {"type": rtype}
    if rtype == "default":
        return float(theta), out
    if rtype == "linear":  # transformers: inv_freq / factor, nothing else
        if rp.get("factor") is None:
            raise _err(fp, f"{where}.factor is missing (rope_type linear needs it)")
        return float(theta), {**out, "factor": _num(rp, "factor", where, fp)}
    rp = dict(rp)
    rp.setdefault("original_max_position_embeddings",
                  hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
    if rp["original_max_position_embeddings"] is None:
        raise _err(fp, f"{where}.original_max_position_embeddings is missing (rope_type {rtype} needs it)")
    if rtype == "yarn":
        if rp.get("truncate", True) not in (True, False):
            raise _err(fp, f"{where}.truncate={json.dumps(rp['truncate'])[:40]} is not supported (true or false)")
        if rp.get("truncate", True) is False:
            out["truncate"] = False
        if rp.get("factor") is None and hf.get("max_position_embeddings"):
            rp["factor"] = hf["max_position_embeddings"] / rp["original_max_position_embeddings"]
        if not rp.get("mscale"):  # transformers: the mscale ratio only when both are set
            rp.pop("mscale", None)
            rp.pop("mscale_all_dim", None)
        if not rp.get("mscale_all_dim"):
            rp.pop("mscale_all_dim", None)
        for k in ("beta_fast", "beta_slow"):  # transformers: `or` defaults (0 or null → 32 / 1)
            if not rp.get(k):
                rp.pop(k, None)
    for k in sorted(_KEYS[rtype] - {"truncate"}):
        if rp.get(k) is None:
            if rtype == "llama3":
                raise _err(fp, f"{where}.{k} is missing (rope_type llama3 needs factor, low_freq_factor, "
                               "high_freq_factor, original_max_position_embeddings)")
            continue
        val = _num(rp, k, where, fp)
        out[_OURS[k]] = int(val) if k == "original_max_position_embeddings" else val
    if "factor" not in out:
        raise _err(fp, f"{where}.factor is missing (rope_type {rtype} needs it)")
    if rtype == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise _err(fp, f"{where}.high_freq_factor={out['high_freq_factor']} must exceed low_freq_factor="
                       f"{out['low_freq_factor']}")
    return float(theta), out


def rope_parameters(cfg) -> dict:
    """Our RoPE (``cfg``: a ModelConfig) as transformers 5's ``rope_parameters``."""
    r = cfg.rope
    out: dict[str, Any] = {"rope_type": r.type, "rope_theta": cfg.rope_theta}
    if r.type == "linear":
        out["factor"] = r.factor
    elif r.type == "llama3":
        out.update(factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                   original_max_position_embeddings=r.original_max_position)
    elif r.type == "yarn":
        out.update(factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                   original_max_position_embeddings=r.original_max_position)
        if r.attention_factor is not None:
            out["attention_factor"] = r.attention_factor
        if r.mscale and r.mscale_all_dim:
            out.update(mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
        if not r.truncate:
            out["truncate"] = False
    return out
