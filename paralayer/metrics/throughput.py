"""Per-step metrics: throughput, TFLOP/s, MFU, memory; sinks: console (rich), metrics.jsonl, W&B.

MFU is only ever computed against a known peak:
* ``cluster.peak_tflops`` when the recipe/profile sets it;
* on a GPU, :data:`DEVICE_PEAK_TFLOPS` matched against ``torch.cuda.get_device_name()``
  (dense bf16 tensor-core peaks from the vendors' datasheets);
* on CPU, a short fp32 GEMM measured at start (:func:`measure_cpu_peak_tflops`) — training runs in
  fp32 on CPU, so that is the peak it can reach;
* an unknown GPU gets ``None`` (no MFU) and a warning, never a made-up figure.

metrics.jsonl holds one JSON object per logged step with at least the DESIGN.md keys ``step, loss,
lr, grad_norm, tokens_per_s, tokens_per_s_per_device, tflops_per_device, mfu, step_time_s,
peak_memory_bytes``; the file is strict JSON (a non-finite float is written as ``null`` and its key
listed under ``nonfinite``). Resume: :func:`last_logged_step` and :func:`truncate_after` let a
resumed run drop records past its checkpoint so no step is ever logged twice.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

# Dense (no sparsity) bf16 tensor-core peak TFLOP/s per device. Sources: NVIDIA/AMD datasheets —
# the "with sparsity" figures there are halved here.
#   A100 (SXM and PCIe): "NVIDIA A100 Tensor Core GPU" datasheet, BF16 312 (624 sparse).
#   A800: export variant of A100, same compute (NVIDIA A800 datasheet, BF16 312).
#   H100 SXM: "NVIDIA H100 Tensor Core GPU" datasheet, BF16 1,979 sparse → 989.
#   H100 PCIe: same datasheet, BF16 1,513 sparse → 756.
#   H100 NVL: same datasheet, BF16 1,671 sparse → 835.
#   H800: export variant of H100 with the same compute (SXM 989, PCIe 756).
#   H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet, BF16 1,979 sparse → 989.
#   H200 NVL: same datasheet, BF16 1,671 sparse → 835.
#   GH200: "NVIDIA GH200 Grace Hopper Superchip" datasheet, BF16 1,979 sparse → 989.
#   B200: "NVIDIA DGX B200"/HGX B200 specs, BF16 4.5 PF sparse per GPU → 2,250.
#   L40S: "NVIDIA L40S" datasheet, BF16 362.05 (733 sparse).
#   L40: "NVIDIA L40" datasheet, BF16 181.05 (362.1 sparse).
#   L4: "NVIDIA L4" datasheet, BF16 242 sparse → 121.
#   A10: "NVIDIA A10" datasheet, BF16 125 (250 sparse). A10G (AWS G5) has no public NVIDIA
#   datasheet; the A10 figure is used — set cluster.peak_tflops if you know better.
#   A40: "NVIDIA A40" datasheet, BF16 149.7 (299.4 sparse).
#   A30: "NVIDIA A30" datasheet, BF16 165 (330 sparse).
#   RTX A6000: "NVIDIA RTX A6000" datasheet, tensor 309.7 sparse → 154.8.
#   V100: no bf16; fp16 tensor-core 125 ("NVIDIA V100" datasheet, SXM2; PCIe 112).
#   MI300X: "AMD Instinct MI300X" datasheet, BF16 1,307.4 dense.  MI250X: 383 dense.
DEVICE_PEAK_TFLOPS: Dict[str, float] = {
    "GH200": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100 SXM": 989.0,
    "H800 PCIe": 756.0,
    "H800": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 125.0,
    "A10": 125.0,
    "A40": 149.7,
    "A30": 165.0,
    "RTX A6000": 154.8,
    "V100 PCIe": 112.0,
    "V100": 125.0,
    "MI300X": 1307.4,
    "MI250X": 383.0,
}

# (pattern on the upper-cased device name, table key); first match wins, so specific names first.
# Seen names: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A10G", "NVIDIA L40S", "NVIDIA L4".
_DEVICE_PATTERNS: List[Tuple[str, str]] = [
    (r"GH200", "GH200"),
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100.*PCIE", "H100 PCIe"),
    (r"H100", "H100 SXM"),
    (r"H800.*PCIE", "H800 PCIe"),
    (r"H800", "H800"),
    (r"\bB200\b", "B200"),
    (r"\bA100\b", "A100"),
    (r"\bA800\b", "A800"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bA40\b", "A40"),
    (r"\bA30\b", "A30"),
    (r"RTX A6000", "RTX A6000"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100"),
    (r"MI300X", "MI300X"),
    (r"MI250X", "MI250X"),
]


def lookup_device_peak_tflops(device_name: str) -> Optional[float]:
    """Dense bf16 peak TFLOP/s for a GPU name as ``torch.cuda.get_device_name()`` gives it, or
    ``None`` if the name is not in :data:`DEVICE_PEAK_TFLOPS`."""
    name = (device_name or "").upper()
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return DEVICE_PEAK_TFLOPS[key]
    return None


def measure_cpu_peak_tflops(dtype: torch.dtype = torch.float32, threads: Optional[int] = None,
                            n: int = 1024, repeats: int = 3) -> float:
    """A short GEMM benchmark: the median over ``repeats`` of an n×n @ n×n matmul (after one warm-up),
    as TFLOP/s (2n³ per matmul). ``threads``: torch threads to use during the measurement (the
    rank's own share of the cores); the previous setting is restored. ~0.1–0.5 s at n=1024."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return 2.0 * n ** 3 / statistics.median(times) / 1e12
    finally:
        torch.set_num_threads(old)


def resolve_peak_tflops(device: Any = "cpu", configured: Optional[float] = None,
                        threads: Optional[int] = None) -> Tuple[Optional[float], str]:
    """The per-device peak for MFU and where it came from: ``(tflops | None, source)``.

    ``configured`` (``cluster.peak_tflops``) wins; a CUDA device → the table (unknown name → None
    and a warning); CPU → :func:`measure_cpu_peak_tflops` in fp32 with ``threads``.
    """
    if configured:
        return float(configured), "cluster.peak_tflops"
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = lookup_device_peak_tflops(name)
        if peak is None:
            warnings.warn(f"no MFU: unknown device {name!r}; set cluster.peak_tflops", stacklevel=2)
            return None, f"unknown device {name}"
        return peak, f"datasheet dense bf16 peak of {name}"
    if dev.type == "cpu":
        return measure_cpu_peak_tflops(torch.float32, threads), "measured fp32 GEMM (CPU)"
    warnings.warn(f"no MFU: unknown device {dev.type!r}; set cluster.peak_tflops", stacklevel=2)
    return None, f"unknown device {dev.type}"


def peak_memory_bytes(device: Any = None) -> int:
    """Peak memory of this process. CUDA: ``torch.cuda.max_memory_allocated(device)`` (tensor
    memory held by the caching allocator's clients, not reserved/fragmented memory). CPU: the
    process's peak resident set size from ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the whole
    process: Python, torch, data — an upper bound on tensor memory)."""
    dev = torch.device(device) if device is not None and not isinstance(device, torch.device) else device
    if dev is not None and dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes; Linux: KiB


def _to_py(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item") and callable(v.item) and type(v).__module__ == "numpy":
        return v.item()
    return v


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
        "loss": float(_to_py(loss)),
        "lr": float(_to_py(lr)),
        "grad_norm": None if grad_norm is None else float(_to_py(grad_norm)),
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / world_size,
        "tflops_per_device": tflops,
        "mfu": mfu,
        "step_time_s": step_time_s,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    if extra:
        rec.update({k: _to_py(v) for k, v in extra.items()})
    return rec


# ---------------------------------------------------------------------------------- jsonl helpers
def _read_records(path: str) -> List[Dict[str, Any]]:
    out = []
    if not os.path.isfile(path):
        return out
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return out


def last_logged_step(path: str) -> Optional[int]:
    """The largest ``step`` among the complete records of a metrics.jsonl, or None (no file or no
    complete record)."""
    recs = _read_records(path)
    return max(r["step"] for r in recs) if recs else None


def truncate_after(path: str, step: int) -> int:
    """Keep only the complete records with ``step <= step`` (dropping lines cut short by a crash),
    rewriting the file atomically; returns how many records were kept. A missing file: 0."""
    if not os.path.isfile(path):
        return 0
    keep = [r for r in _read_records(path) if r["step"] <= step]
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".metrics-", dir=d)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return len(keep)


def _strict_json_record(record: Dict[str, Any]) -> Dict[str, Any]:
    rec = {k: _to_py(v) for k, v in record.items()}
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    for k in bad:
        rec[k] = None
    if bad:
        rec["nonfinite"] = bad
    return rec


# ---------------------------------------------------------------------------------- the logger
def _wait_for_run_file(path: Optional[str], timeout_s: float = 10.0) -> None:
    """wandb 0.31's core process may still be writing the offline run file when ``finish()``
    returns (seen: only the 7-byte header right after it). Wait until it has records and its size
    holds still, so that a check right after the run ends finds a complete file."""
    if not path:
        return
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        if size > 7 and size == last:
            return
        last = size
        time.sleep(0.05)


class MetricsLogger:
    """Console (rich progress bar + closing summary), ``run_dir/metrics.jsonl`` and W&B.

    Only the logging rank (``is_logging_rank``) does anything; on the others every method is a no-op.
    metrics.jsonl is opened for append (a resumed run continues it; call :func:`truncate_after`
    first to drop steps past the checkpoint) and flushed after each line. W&B: ``wandb_mode`` offline
    (default; ``run_dir/wandb/offline-run-*/run-*.wandb``) | online | disabled (wandb is not even
    imported); WANDB_DIR/WANDB_CACHE_DIR/WANDB_CONFIG_DIR/WANDB_DATA_DIR are pointed inside
    ``run_dir`` so nothing lands outside it; its config is ``{"recipe": cfg_dict, "plan": plan_dict}``.
    Console: a live bar on a terminal; otherwise (SLURM logs, pipes) a plain line about every 5%.
    """

    def __init__(self, run_dir: str, cfg_dict: Dict[str, Any], plan_dict: Dict[str, Any],
                 is_logging_rank: bool, wandb_mode: str = "offline",
                 wandb_project: str = "paralayer", wandb_group: Optional[str] = None,
                 total_steps: int = 0, progress: bool = True, run_name: Optional[str] = None,
                 peak_source: Optional[str] = None, console: Any = None):
        self.enabled = bool(is_logging_rank)
        self.run_dir = run_dir
        self.total_steps = int(total_steps or 0)
        self.records: List[Dict[str, Any]] = []
        self.peak_source = peak_source
        self._file = None
        self._progress = None
        self._task = None
        self._wandb_run = None
        self._closed = False
        if not self.enabled:
            return
        from rich.console import Console

        os.makedirs(run_dir, exist_ok=True)
        self.console = console or Console(stderr=False)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a+", encoding="utf-8")
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() > 0:  # make sure we start on a fresh line after a crash
            self._file.seek(self._file.tell() - 1)
            last = self._file.read(1)
            self._file.seek(0, os.SEEK_END)
            if last != "\n":
                self._file.write("\n")
                self._file.flush()
        self._show = bool(progress)
        self._plain_every = max(1, self.total_steps // 20) if self.total_steps else 1
        if self._show and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=self.total_steps or None, info="")
            self._progress.start()
        if wandb_mode and wandb_mode != "disabled":
            self._init_wandb(wandb_mode, wandb_project, wandb_group, cfg_dict, plan_dict, run_name)

    # -------------------------------------------------------------- W&B
    def _init_wandb(self, mode, project, group, cfg_dict, plan_dict, run_name):
        run_dir = os.path.abspath(self.run_dir)
        os.environ["WANDB_DIR"] = run_dir
        os.environ["WANDB_CACHE_DIR"] = os.path.join(run_dir, "wandb", ".cache")
        os.environ["WANDB_CONFIG_DIR"] = os.path.join(run_dir, "wandb", ".config")
        os.environ["WANDB_DATA_DIR"] = os.path.join(run_dir, "wandb", ".data")
        os.environ.setdefault("WANDB_SILENT", "true")
        for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.makedirs(os.environ[k], exist_ok=True)
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self._wandb_run = wandb.init(mode=mode, project=project, group=group, dir=run_dir,
                                     name=run_name, config={"recipe": cfg_dict, "plan": plan_dict},
                                     settings=settings)

    # -------------------------------------------------------------- logging
    def log(self, step: int, record: Dict[str, Any]) -> None:
        """Write one record (``step`` is set into it) to metrics.jsonl, the console and W&B."""
        if not self.enabled or self._closed:
            return
        rec = _strict_json_record({**record, "step": int(step)})
        rec = {"step": rec.pop("step"), **rec}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self.records.append(rec)
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in rec.items()
                                 if k != "step" and isinstance(v, (int, float)) and v is not None},
                                step=int(step))
        info = self._info(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=int(step), info=info)
        elif self._show and (step % self._plain_every == 0 or step == self.total_steps or step == 1):
            tot = f"/{self.total_steps}" if self.total_steps else ""
            self.console.print(f"step {step}{tot}  {info}", highlight=False)

    @staticmethod
    def _info(rec: Dict[str, Any]) -> str:
        parts = []
        if rec.get("loss") is not None:
            parts.append(f"loss {rec['loss']:.4f}")
        if rec.get("tokens_per_s") is not None:
            parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        if rec.get("mfu") is not None:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        return "  ".join(parts)

    # -------------------------------------------------------------- summary
    def summary(self) -> Dict[str, Any]:
        """Medians over the logged steps (the first step, warm-up, is left out when there are ≥3),
        max peak memory, first/last loss."""
        recs = self.records
        timed = recs[1:] if len(recs) >= 3 else recs

        def med(key):
            vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
            return statistics.median(vals) if vals else None

        mems = [r["peak_memory_bytes"] for r in recs if isinstance(r.get("peak_memory_bytes"), int)]
        losses = [r for r in recs if r.get("loss") is not None]
        return {
            "steps_logged": len(recs),
            "tokens_per_s": med("tokens_per_s"),
            "tokens_per_s_per_device": med("tokens_per_s_per_device"),
            "tflops_per_device": med("tflops_per_device"),
            "mfu": med("mfu"),
            "step_time_s": med("step_time_s"),
            "peak_memory_bytes": max(mems) if mems else None,
            "first_loss": losses[0]["loss"] if losses else None,
            "last_loss": losses[-1]["loss"] if losses else None,
        }

    def close(self) -> Optional[Dict[str, Any]]:
        """Stop the bar, print the summary table, finish W&B, close metrics.jsonl. Idempotent."""
        if not self.enabled or self._closed:
            return None
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        s = self.summary()
        if self._show and self.records:
            self.console.print(self._table(s))
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            sync_file = getattr(getattr(run, "settings", None), "sync_file", None)
            for k, v in s.items():
                if v is not None:
                    run.summary[k] = v
            run.finish()
            _wait_for_run_file(sync_file)
        if self._file is not None:
            self._file.close()
        return s

    def _table(self, s: Dict[str, Any]):
        from rich.table import Table

        def f(v, fmt):
            return "n/a" if v is None else format(v, fmt)

        t = Table(title="paralayer run summary", show_header=True)
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("steps logged", str(s["steps_logged"]))
        t.add_row("tokens/s (median)", f(s["tokens_per_s"], ",.0f"))
        t.add_row("tokens/s per device", f(s["tokens_per_s_per_device"], ",.0f"))
        t.add_row("TFLOP/s per device", f(s["tflops_per_device"], ".3f"))
        mfu = "n/a (no peak known)" if s["mfu"] is None else f"{100 * s['mfu']:.2f}%"
        if self.peak_source and s["mfu"] is not None:
            mfu += f"  [{self.peak_source}]"
        t.add_row("MFU", mfu)
        t.add_row("step time (median)", f(s["step_time_s"], ".3f") + (" s" if s["step_time_s"] else ""))
        mem = s["peak_memory_bytes"]
        t.add_row("peak memory", "n/a" if mem is None else f"{mem / 2**20:,.1f} MiB")
        t.add_row("loss first → last", f"{f(s['first_loss'], '.4f')} → {f(s['last_loss'], '.4f')}")
        return t

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
