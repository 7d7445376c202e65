#!/usr/bin/env bash
# The GPU benchmark: one command, under 5 minutes on one GPU.
#  1. trains the ~1.5B dense recipe (recipes/llama-1b.yaml) in bf16 for 30 steps through the real
#     launcher, printing tokens/s and MFU (against the device's datasheet peak);
#  2. times our model against transformers' LlamaForCausalLM on the same 1B shapes, same GPU,
#     bf16 autocast, forward + backward + AdamW, alternating; prints the tokens/s ratio.
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (writes OUT_DIR/gpu-bench.md)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-runs/gpu-bench}}"
mkdir -p "$OUT"
CACHE="$OUT/cache"  # data.cache_dir below
python -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.cuda.get_device_name(0), torch.__version__)" | tee "$OUT/device.txt"
python launch.py recipe=llama-1b cluster=local cluster.device=cuda cluster.devices_per_node=1 \
    train.steps=30 logging.wandb.mode=disabled run.dir="$OUT/llama-1b" data.cache_dir="$CACHE" 2>&1 | tee "$OUT/train.log" | grep -v "^step [0-9]*/" || true
python - "$OUT" <<'PY' | tee "$OUT/gpu-bench.md"
import json, statistics, sys
out = sys.argv[1]
recs = [json.loads(l) for l in open(f"{out}/llama-1b/metrics.jsonl")][3:]
dev = open(f"{out}/device.txt").read().split("\n")[0]
med = lambda k: statistics.median(r[k] for r in recs if r.get(k) is not None)
print(f"| device | recipe | steps (median of) | tokens/s | TFLOP/s per GPU | MFU | step time (s) | peak memory (GiB) |")
print("|---|---|---|---|---|---|---|---|")
mfu = med("mfu") if any(r.get("mfu") is not None for r in recs) else None
print(f"| {dev} | llama-1b bf16, micro_batch 2, seq 2048 | {len(recs)} | {med('tokens_per_s'):,.0f} | "
      f"{med('tflops_per_device'):.1f} | {'n/a' if mfu is None else f'{100*mfu:.1f}%'} | {med('step_time_s'):.3f} | "
      f"{med('peak_memory_bytes')/2**30:.1f} |")
PY
python benchmarks/hf_compare.py --device cuda --dtype bf16 --d-model 2048 --layers 16 --heads 32 --kv-heads 8 \
    --ffn 8192 --vocab 128256 --seq 2048 --batch 2 --steps 10 --warmup 3 | tee -a "$OUT/gpu-bench.md"
# The pipeline bubble on this box's dedicated CPU cores (gloo, one thread per rank): the 2-vCPU
# development VM's jitter keeps m >= 8 above 1.2x the formula (docs/BENCHMARKS.md §3).
timeout 300 python benchmarks/bubble.py --png "$OUT/pipeline-timeline.png" | tee "$OUT/bubble.md" || true
