#!/usr/bin/env bash
# The GPU benchmark: one prepared command for a lent GPU, about 11 minutes on one H200/H100.
#   1. llama-1b (recipes/llama-1b.yaml, 1.2B) in bf16 through the real launcher, compile off and
#      on: tokens/s and MFU (median after 3 warm-up steps; peak from the device's datasheet);
#   1b. llama-1b in FP8 (train.precision=fp8, tensorwise, compile on) against 1's bf16 compiled run,
#      over the same steps and data: tokens/s and loss (issue #44);
#   2. our model against transformers' LlamaForCausalLM on the same 1B shapes, same GPU (ratio);
#   3. the CUDA tests (tests/test_gpu.py: ring kernels, bf16/compile parity, a llama-1b step);
#   4. the pipeline bubble benchmark (benchmarks/bubble.py, gloo) on the box's CPU cores, run
#      beside 1-3 (it uses two of the CPU cores; the GPU parts use one).
# Prints a table and, last, one JSON line; exits non-zero if any part failed. About 11 minutes.
# Packages the box lacks (omegaconf, submitit, wandb, datasets...) come as wheels in .whl/
# (made here by benchmarks/gpu_wheels.sh, carried with the tree) and are installed into a target
# directory only when an import is missing.
# Usage: bash benchmarks/gpu.sh [OUT_DIR]      (default runs/gpu-bench)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu-bench}"
STEPS="${GPU_BENCH_STEPS:-12}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
declare -A STATUS

if ! python -c "import omegaconf, submitit, wandb, datasets" 2>/dev/null; then
    SITE="${PARALAYER_SITE:-/tmp/paralayer-site}"
    ls .whl/*.whl >/dev/null 2>&1 || { echo "missing packages and no .whl/ (run benchmarks/gpu_wheels.sh here first)" >&2; exit 2; }
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    python -c "import omegaconf, submitit, wandb, datasets" || exit 2
fi
python -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.cuda.get_device_name(0)); print(torch.__version__)" \
    > "$OUT/device.txt" || { echo "no GPU visible" >&2; exit 2; }
echo "device: $(head -1 "$OUT/device.txt"), torch $(tail -1 "$OUT/device.txt"), $(nproc) CPU cores"

# 4 (beside the rest): the bubble on dedicated CPU cores
( timeout 400 python benchmarks/bubble.py --schedules 1f1b --ms 8,16 --steps 3 --png-m 8 \
      --png "$OUT/pipeline-timeline.png" > "$OUT/bubble.md" 2>&1 ) &
BUBBLE_PID=$!

run_part() {  # name timeout command...: record ok/failed, keep the log
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then STATUS[$name]=ok; else STATUS[$name]="failed (rc $?)"; fi
    echo "$name: ${STATUS[$name]} in $(( $(date +%s) - t0 )) s"
}

# 1. llama-1b bf16, compile off and on
for c in false true; do
    run_part "llama1b-compile-$c" 240 python launch.py recipe=llama-1b cluster=local cluster.device=cuda \
        cluster.devices_per_node=1 train.steps="$STEPS" train.compile=$c logging.wandb.mode=disabled \
        logging.progress=false run.dir="$OUT/llama1b-compile-$c" data.cache_dir="$OUT/cache"
done
# 1b. llama-1b FP8 (tensorwise; torchao's float8 wants compile), the same steps as the bf16 compiled run
run_part llama1b-fp8 240 python launch.py recipe=llama-1b cluster=local cluster.device=cuda \
    cluster.devices_per_node=1 train.steps="$STEPS" train.compile=true train.precision=fp8 \
    train.fp8.recipe=tensorwise logging.wandb.mode=disabled logging.progress=false run.dir="$OUT/llama1b-fp8" \
    data.cache_dir="$OUT/cache"
# 2. ours vs transformers, same shapes (bf16 autocast, fp32 master weights, AdamW)
run_part hf-compare 150 python benchmarks/hf_compare.py --device cuda --dtype bf16 --d-model 2048 --layers 16 \
    --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 2048 --batch 2 --steps 6 --warmup 2
# 3. the CUDA tests
run_part cuda-tests 200 python -m pytest tests/test_gpu.py -q -rs -p no:cacheprovider

if wait "$BUBBLE_PID"; then STATUS[bubble]=ok; else STATUS[bubble]="failed (rc $?)"; fi
echo "bubble: ${STATUS[bubble]}"

python - "$OUT" "$(( $(date +%s) - START ))" "${STATUS[llama1b-compile-false]}" "${STATUS[llama1b-compile-true]}" \
    "${STATUS[llama1b-fp8]}" "${STATUS[hf-compare]}" "${STATUS[cuda-tests]}" "${STATUS[bubble]}" <<'PY'
import json, os, re, statistics, sys

out, seconds = sys.argv[1], int(sys.argv[2])
names = ["llama1b-compile-false", "llama1b-compile-true", "llama1b-fp8", "hf-compare", "cuda-tests", "bubble"]
status = dict(zip(names, sys.argv[3:]))
dev, torch_v = open(f"{out}/device.txt").read().split("\n")[:2]
res = {"device": dev, "torch": torch_v, "seconds": seconds, "status": status}


def train_figures(run):
    path = f"{out}/{run}/metrics.jsonl"
    if not os.path.exists(path):
        return None
    recs = [json.loads(line) for line in open(path)][3:]  # 3 warm-up steps (compile happens there)
    if not recs:
        return None
    med = lambda k: statistics.median(r[k] for r in recs if r.get(k) is not None)  # noqa: E731
    return {"steps": len(recs), "tokens_per_s": med("tokens_per_s"), "tflops": med("tflops_per_device"),
            "mfu": med("mfu") if any(r.get("mfu") is not None for r in recs) else None,
            "step_time_s": med("step_time_s"), "peak_memory_gib": med("peak_memory_bytes") / 2**30}


for c in ("false", "true"):
    res[f"llama1b_compile_{c}"] = train_figures(f"llama1b-compile-{c}")
res["llama1b_fp8"] = train_figures("llama1b-fp8")


def losses(run):
    path = f"{out}/{run}/metrics.jsonl"
    return [r["loss"] for r in map(json.loads, open(path)) if "loss" in r] if os.path.exists(path) else []


bf, f8 = losses("llama1b-compile-true"), losses("llama1b-fp8")
n = min(len(bf), len(f8))
res["fp8_vs_bf16"] = None if not (n and res["llama1b_fp8"] and res["llama1b_compile_true"]) else {
    "steps": n, "loss_bf16": bf[n - 1], "loss_fp8": f8[n - 1], "loss_gap": (f8[n - 1] - bf[n - 1]) / bf[n - 1],
    "max_step_loss_gap": max(abs(a - b) / b for a, b in zip(f8[:n], bf[:n])),
    "tokens_per_s_ratio": res["llama1b_fp8"]["tokens_per_s"] / res["llama1b_compile_true"]["tokens_per_s"]}
log = open(f"{out}/hf-compare.log").read() if os.path.exists(f"{out}/hf-compare.log") else ""
m = re.search(r"ratio paralayer / transformers tokens/s: \*\*([0-9.]+)\*\*", log)
res["ours_over_transformers"] = float(m.group(1)) if m else None
tl = open(f"{out}/cuda-tests.log").read() if os.path.exists(f"{out}/cuda-tests.log") else ""
m = re.search(r"(\d+) passed", tl)
res["cuda_tests_passed"] = int(m.group(1)) if m else 0
res["cuda_tests_skipped"] = int(re.search(r"(\d+) skipped", tl).group(1)) if "skipped" in tl else 0
rows = [line for line in open(f"{out}/bubble.md") if line.startswith("| 1f1b")] if os.path.exists(f"{out}/bubble.md") else []
res["bubble"] = [{"m": int(c[2]), "formula": float(c[3]), "measured": float(c[4]), "measured_over_formula": float(c[5]),
                  "replayed": float(c[7])} for c in (r.split("|") for r in rows)]

print(f"\n| {dev} | tokens/s | TFLOP/s | MFU | step (s) | peak GiB |\n|---|---|---|---|---|---|")
for c in ("false", "true"):
    f = res[f"llama1b_compile_{c}"]
    if f:
        mfu = "n/a" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
        print(f"| llama-1b bf16, compile {'on' if c == 'true' else 'off'} | {f['tokens_per_s']:,.0f} | "
              f"{f['tflops']:.0f} | {mfu} | {f['step_time_s']:.3f} | {f['peak_memory_gib']:.1f} |")
f = res["llama1b_fp8"]
if f:
    mfu = "n/a" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
    print(f"| llama-1b FP8 tensorwise, compile on | {f['tokens_per_s']:,.0f} | {f['tflops']:.0f} | {mfu} | "
          f"{f['step_time_s']:.3f} | {f['peak_memory_gib']:.1f} |")
g = res["fp8_vs_bf16"]
if g:
    print(f"\nllama-1b FP8 / bf16 (compile on, {g['steps']} steps, same data): tokens/s x{g['tokens_per_s_ratio']:.2f}; "
          f"last loss {g['loss_fp8']:.4f} vs {g['loss_bf16']:.4f} ({100 * g['loss_gap']:+.2f}%), "
          f"largest per-step gap {100 * g['max_step_loss_gap']:.2f}%")
print(f"\nours / transformers LlamaForCausalLM tokens/s: {res['ours_over_transformers']}")
print(f"CUDA tests: {res['cuda_tests_passed']} passed, {res['cuda_tests_skipped']} skipped")
for b in res["bubble"]:
    print(f"bubble 1f1b pp2 m={b['m']}: measured {b['measured']:.3f} = {b['measured_over_formula']:.2f}x formula "
          f"{b['formula']:.3f} (replay {b['replayed']:.3f})")
ok = all(v == "ok" for v in status.values()) and res["cuda_tests_skipped"] == 0 and all(
    res[f"llama1b_compile_{c}"] for c in ("false", "true")) and res["ours_over_transformers"] is not None \
    and res["fp8_vs_bf16"] is not None
res["ok"] = ok
print(json.dumps(res))
sys.exit(0 if ok else 1)
PY
