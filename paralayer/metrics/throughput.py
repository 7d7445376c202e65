"""Per-step throughput: tokens/s, TFLOP/s per device, MFU and peak memory, and the medians that
sum a run up (the run's closing table and the sweep report use the same :func:`summarize`).

metrics.jsonl holds one record per logged step with at least the DESIGN.md keys ``step, loss,
lr, grad_norm, tokens_per_s, tokens_per_s_per_device, tflops_per_device, mfu, step_time_s,
peak_memory_bytes``. Torch is imported only to read a device's memory, so the report can use
:func:`summarize` without it.
"""
from __future__ import annotations

import statistics
import sys
from typing import Any, Dict, List, Optional

from paralayer.metrics.jsonl import to_py


def peak_memory_bytes(device: Any = None) -> int:
    """Peak memory of this process. CUDA: ``torch.cuda.max_memory_allocated(device)`` (tensor
    memory held by the caching allocator's clients, not reserved/fragmented memory). CPU: the
    process's peak resident set size from ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the whole
    process: Python, torch, data — an upper bound on tensor memory)."""
    if device is not None:
        import torch

        dev = device if isinstance(device, torch.device) else torch.device(device)
        if dev.type == "cuda":
            return int(torch.cuda.max_memory_allocated(dev))
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes; Linux: KiB


def step_record(step: int, loss: float, lr: float, grad_norm: Optional[float], tokens: int,
                step_time_s: float, world_size: int, flops_per_token: Optional[float],
                peak_tflops: Optional[float], device: Any = None,
                extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One metrics.jsonl record.

    ``tokens``: tokens processed by the whole step (global_batch · seq_len); ``flops_per_token``:
    the resolver's training FLOPs per token (forward + backward); ``world_size``: devices in the run.
    tokens_per_s = tokens / step_time_s; tokens_per_s_per_device = tokens_per_s / world_size;
    tflops_per_device = flops_per_token · tokens_per_s / world_size / 1e12; mfu =
    tflops_per_device / peak_tflops, or None without a peak. peak_memory_bytes: see
    :func:`peak_memory_bytes`. ``extra`` (e.g. ``bubble_measured``) is merged in.
    """
    step_time_s = float(step_time_s)
    tps = tokens / step_time_s if step_time_s > 0 else float("nan")
    tflops = (flops_per_token * tps / world_size / 1e12) if flops_per_token else None
    mfu = (tflops / peak_tflops) if (tflops is not None and peak_tflops) else None
    rec: Dict[str, Any] = {
        "step": int(step),
        "loss": float(to_py(loss)),
        "lr": float(to_py(lr)),
        "grad_norm": None if grad_norm is None else float(to_py(grad_norm)),
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / world_size,
        "tflops_per_device": tflops,
        "mfu": mfu,
        "step_time_s": step_time_s,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    if extra:
        rec.update({k: to_py(v) for k, v in extra.items()})
    return rec


#: the per-step keys :func:`summarize` takes the median of
MEDIAN_KEYS = ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "step_time_s",
               "bubble_measured")


def summarize(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the logged steps (the first step, warm-up, is left out when there are ≥3), the
    max peak memory, the first and last loss. A key no record has is None."""
    timed = records[1:] if len(records) >= 3 else records

    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return statistics.median(vals) if vals else None

    mems = [r["peak_memory_bytes"] for r in records if isinstance(r.get("peak_memory_bytes"), int)]
    losses = [r for r in records if r.get("loss") is not None]
    out: Dict[str, Any] = {"steps_logged": len(records)}
    out.update({k: med(k) for k in MEDIAN_KEYS})
    out.update(peak_memory_bytes=max(mems) if mems else None,
               first_loss=losses[0]["loss"] if losses else None,
               last_loss=losses[-1]["loss"] if losses else None)
    return out
