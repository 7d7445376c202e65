"""What FP8 does to a step's time: each GEMM's FP8 time from its local shape after sharding, and
the casts it needs, as a change to the bf16 step the rest of the cost model times.

Why a change and not a second model: every bf16 plan must keep its figures to the byte, so the
FP8 step is the bf16 step less, per FP8 GEMM on the busiest rank, ``t_bf16 · (1 − r) − casts``.

- ``t_bf16``: the GEMM's time as the bf16 model counts it, 2·M·K·N / (peak · efficiency) per pass
  (forward, input-grad, weight-grad), M = the tokens of one microbatch on the rank (the gathered
  sequence under sequence parallel), K, N the weight's local shape after tp (resolve/fp8.local_gemms).
- ``r``: FP8 over bf16 time of the three passes of that shape, from a roofline with fitted
  efficiencies: each pass costs 2·M·K·N / (peak_p · η_p) + its operand and output bytes / HBM
  (FP8 operands 1 byte, bf16 2; outputs bf16). η_bf16, η_tensorwise, η_rowwise are fitted on
  torchao's H100 microbenchmarks (benchmarks/calibrate_fp8.py, docs/planner.md "FP8"); small
  shapes are memory-bound, so their FP8 gain shrinks — the gain follows the local shapes.
- casts: bytes read and written per element of the input (M×K), weight (K×N) and output grad
  (M×N) by the recipe's scale and cast kernels (torchao's ``roofline_utils`` kernel list for
  tensorwise and rowwise; blockwise as its 1×128 activations / 128×128 weights need: two
  activation casts, a weight cast and an FP8 transpose) at HBM speed.

FP8_CALIBRATION holds the fitted numbers; the step-level ``overlap`` share of the casts is fitted
on torchtitan's published bf16/FP8 pairs (same layout, same framework). Torch-free.
"""
from __future__ import annotations

from typing import NamedTuple

from paralayer.config import Config
from paralayer.resolve.fp8 import fp8_copy_saving, fp8_gathered_params, fp8_layers, layer_gemm_shapes  # noqa: F401
from paralayer.resolve.model_parts import is_moe_layer

#: Fitted by benchmarks/calibrate_fp8.py (docs/planner.md "FP8" has the fit and its residuals):
#: ``gemm_efficiency``: the share of the dense peak the GEMM passes reach in torchao's H100
#: microbenchmark (bf16 and rowwise on its 216-shape rowwise table, tensorwise on the two shapes its
#: README states; blockwise has no published table here and takes rowwise's: a stated assumption);
#: ``cast_efficiency``: the share of HBM speed the cast kernels reach there (same fit);
#: ``cast_share``: the share of those casts a whole training step pays once torch.compile fuses
#: them into the kernels around them (fitted per recipe on torchtitan's H100 bf16/FP8 pairs);
#: ``hbm_efficiency``: the share of HBM speed a GEMM's operands stream at (torchao's roofline, not fitted).
FP8_CALIBRATION: dict = {
    "gemm_efficiency": {"bf16": 0.267, "tensorwise": 0.236, "rowwise": 0.282, "blockwise": 0.282},
    "cast_efficiency": {"tensorwise": 0.356, "rowwise": 0.152, "blockwise": 0.152},
    "cast_share": {"tensorwise": 0.048, "rowwise": 0.384, "blockwise": 0.384},
    "hbm_efficiency": 0.92,
}
#: HBM bytes of the casts per element of (input M×K, weight K×N, output grad M×N) over a GEMM's
#: forward + backward (torchao/testing/training/roofline_utils.py, unfused): tensorwise reads a
#: tensor for its amax, then writes it in FP8 row- and column-major (the weight in two kernels);
#: rowwise casts each layout apart with a bf16 transpose between; blockwise as mxfp8's 32×32-weight
#: layout there (activations cast along both dims, the weight once and transposed in FP8).
CAST_BYTES = {"tensorwise": (6.0, 8.0, 6.0), "rowwise": (8.0, 10.0, 8.0), "blockwise": (6.0, 5.0, 6.0)}
PASSES = 3  # forward, input-grad, weight-grad


def pass_seconds(m: float, k: float, n: float, precision: str, peak_flops: float, hbm: float,
                 cal: dict = FP8_CALIBRATION) -> float:
    """One GEMM's forward + input-grad + weight-grad time on the roofline with fitted efficiency
    (``precision``: bf16 or a recipe; ``peak_flops``: that precision's peak in FLOP/s)."""
    eff = cal["gemm_efficiency"][precision]
    e = 2.0 if precision == "bf16" else 1.0
    flops = PASSES * 2.0 * m * k * n / (peak_flops * eff)
    # fwd: x(MK), w(KN) -> MN; dgrad: go(MN), w(KN) -> MK; wgrad: x(MK), go(MN) -> KN (outputs bf16)
    operand = e * ((m * k + k * n) + (m * n + k * n) + (m * k + m * n))
    out = 2.0 * (m * n + m * k + k * n)
    return flops + (operand + out) / (hbm * cal["hbm_efficiency"])


def fp8_ratio(m: float, k: float, n: float, recipe: str, peak_bf16: float, peak_fp8: float, hbm: float,
              cal: dict = FP8_CALIBRATION) -> float:
    """FP8 over bf16 time of one GEMM shape's three passes (casts apart)."""
    return (pass_seconds(m, k, n, recipe, peak_fp8, hbm, cal) / pass_seconds(m, k, n, "bf16", peak_bf16, hbm, cal))


def cast_bytes(m: float, k: float, n: float, recipe: str) -> float:
    """HBM bytes of one GEMM's casts over its forward + backward (CAST_BYTES)."""
    a, w, g = CAST_BYTES[recipe]
    return a * m * k + w * k * n + g * m * n


def microbench_speedup(m: float, k: float, n: float, recipe: str, peak_bf16: float, peak_fp8: float, hbm: float,
                       cal: dict = FP8_CALIBRATION) -> float:
    """torchao's microbenchmark (LayerNorm → Linear → Sigmoid, forward + backward), bf16 time over
    FP8 time, of the linear and its casts: the norm and the sigmoid run the same in both arms and
    are left out (with them, 10 bytes per element of M×K and M×N, the fit's error moves < 1%)."""
    bf16 = pass_seconds(m, k, n, "bf16", peak_bf16, hbm, cal)
    fp8 = pass_seconds(m, k, n, recipe, peak_fp8, hbm, cal) + cast_seconds(m, k, n, recipe, hbm, cal)
    return bf16 / fp8


def cast_seconds(m: float, k: float, n: float, recipe: str, hbm: float, cal: dict = FP8_CALIBRATION) -> float:
    """One GEMM's casts over its forward + backward at the cast kernels' share of HBM speed."""
    return cast_bytes(m, k, n, recipe) / (hbm * cal["cast_efficiency"][recipe])


class Fp8Step(NamedTuple):
    """Seconds per step on the busiest rank: what FP8 saves on its GEMMs (work and recompute),
    what its casts cost, the FP8 GEMMs' own time and their bf16 time."""

    save_work: float
    save_recompute: float
    fp8_gemm_s: float
    bf16_of_fp8_gemm_s: float
    cast_s: float


def step_change(cfg: Config, layers: list[int], tp: int, tokens: float, mm: int, full_layers: set,
                efficiency: float, peak_bf16: float, peak_fp8: float, hbm: float,
                cal: dict = FP8_CALIBRATION) -> Fp8Step:
    """FP8's change to one rank's step: ``layers`` the rank's blocks, ``tokens`` per microbatch
    (M of its GEMMs), ``mm`` microbatches, ``full_layers`` the blocks full recompute reruns (their
    forward GEMMs and input/weight casts run again), ``efficiency`` the bf16 model's matmul share."""
    recipe = cfg.train.fp8.recipe
    fp8 = set(fp8_layers(cfg))
    share = cal["cast_share"][recipe] / (hbm * cal["cast_efficiency"][recipe])
    memo: dict = {}
    save_w = save_r = t_f = t_b = casts = 0.0
    for i in layers:
        if i not in fp8:
            continue
        moe = is_moe_layer(cfg, i)
        if moe not in memo:
            sw = tf = tb = cs = cs_fwd = sf = 0.0
            for _, m_, k, n, count in layer_gemm_shapes(cfg, tp, tokens, moe):
                b = PASSES * 2.0 * m_ * k * n / (peak_bf16 * efficiency) * count
                r = fp8_ratio(m_, k, n, recipe, peak_bf16, peak_fp8, hbm, cal)
                a_, w_, _ = CAST_BYTES[recipe]
                sw += b * (1.0 - r)
                sf += b * (1.0 - r) / PASSES
                tf += b * r
                tb += b
                cs += cast_bytes(m_, k, n, recipe) * share * count
                cs_fwd += (a_ * m_ * k + w_ * k * n) * share * count
            memo[moe] = (sw, tf, tb, cs, sf, cs_fwd)
        sw, tf, tb, cs, sf, cs_fwd = memo[moe]
        save_w += sw - cs
        t_f += tf
        t_b += tb
        casts += cs
        if i in full_layers:  # the rerun forward: its GEMMs in FP8, its input and weight cast again
            save_r += sf - cs_fwd
            t_f += tf / PASSES
            t_b += tb / PASSES
            casts += cs_fwd
    return Fp8Step(save_w * mm, save_r * mm, t_f * mm, t_b * mm, casts * mm)


def full_layers(recompute: str, every: int, layers) -> set:
    """The blocks full recompute reruns (recompute_every=k: i % k == 0, memory.states.layer_recompute)."""
    return {i for i in layers if recompute == "full" and i % max(every, 1) == 0}


def peaks(mach) -> tuple[float, float]:
    """(bf16, FP8) dense peaks of the machine in FLOP/s."""
    return mach.peak_tflops * 1e12, mach.peak_fp8_tflops * 1e12


__all__ = ["FP8_CALIBRATION", "CAST_BYTES", "Fp8Step", "pass_seconds", "fp8_ratio", "cast_bytes",
           "microbench_speedup", "cast_seconds", "step_change", "full_layers", "fp8_gathered_params",
           "fp8_copy_saving", "peaks"]
