"""How a run computes in bf16: FSDP2's MixedPrecisionPolicy where FSDP shards, autocast elsewhere.

Under ZeRO 2/3 FSDP2 already all-gathers each block's weights before its forward; with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` it gathers them in bf16 (half the
traffic), computes in bf16 and reduce-scatters the gradients in fp32 into fp32 shards that the
optimizer steps: torchtitan's and Megatron's recipe. Autocast on top would only re-cast. Without
FSDP (ZeRO 0/1, or a single data rank) the weights stay fp32 and ``torch.autocast`` runs the GEMMs
in bf16. The resolver's memory model counts the same choice (``resolve.memory.precision_mode``).
"""
from __future__ import annotations

from typing import Optional

import torch

from paralayer.config import Config
from paralayer.resolve.memory import precision_mode


def run_precision(cfg: Config, device: torch.device) -> str:
    """'fp32' or 'bf16' (train.precision=auto: bf16 on CUDA, fp32 on CPU); fp8 runs its FP8 GEMMs
    (model/float8.py) inside the same base precision (resolve.rules.resolve_precision)."""
    p = cfg.train.precision
    if p == "fp8" and cfg.train.fp8.base_precision != "auto":
        return cfg.train.fp8.base_precision  # --rehearse of a GPU plan on CPU: bf16 around the FP8 GEMMs
    if p in ("auto", "fp8"):
        return "bf16" if device.type == "cuda" else "fp32"
    return p


def mode(cfg: Config, device: torch.device, dp_cp: int) -> str:
    """'fp32', 'bf16-autocast' or 'bf16-fsdp' for this run (see the module docstring)."""
    return precision_mode(run_precision(cfg, device), int(cfg.parallel.zero), dp_cp)


def fsdp_param_dtype(precision_mode_: str) -> Optional[torch.dtype]:
    """The dtype FSDP2 gathers and computes in (None: the parameters' own, fp32)."""
    return torch.bfloat16 if precision_mode_ == "bf16-fsdp" else None


def autocast_dtype(precision_mode_: str) -> Optional[torch.dtype]:
    """The dtype for ``torch.autocast`` (None: no autocast)."""
    return torch.bfloat16 if precision_mode_ == "bf16-autocast" else None
