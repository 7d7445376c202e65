"""The per-device peak that MFU is measured against.

MFU is only ever computed against a known peak:
* ``cluster.peak_tflops`` when the recipe/profile sets it;
* on a GPU, :data:`DEVICE_PEAK_TFLOPS` matched against ``torch.cuda.get_device_name()``
  (dense bf16 tensor-core peaks from the vendors' datasheets);
* on CPU, a short fp32 GEMM measured at start (:func:`measure_cpu_peak_tflops`) — training runs in
  fp32 on CPU, so that is the peak it can reach;
* an unknown GPU gets ``None`` (no MFU) and a warning, never a made-up figure.
"""
from __future__ import annotations

import re
import statistics
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
