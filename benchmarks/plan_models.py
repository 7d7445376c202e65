"""--plan for this round's model families: CPU seconds (median of 3) and the best layout of each
(docs/BENCHMARKS.md, "Planning the model families").

    PYTHONPATH=. python benchmarks/plan_models.py
"""
import gc
import statistics
import sys
import time

from paralayer.config import load_config
from paralayer.resolve import planner
from paralayer.resolve.planner import report as plan_report

CASES = [["recipe=deepseek-v3"], ["recipe=deepseek-v3", "parallel.schedule=dualpipev"],
         ["recipe=qwen3-235b-a22b"], ["recipe=qwen3-235b-a22b", "parallel.schedule=dualpipev"],
         ["recipe=qwen3-32b"], ["recipe=qwen3-32b", "model.sliding_window=1024", "model.full_attention_every=4"],
         ["recipe=qwen3-30b-a3b"], ["recipe=llama3.1-8b"]]
for ov in CASES:
    cfg = load_config(ov)
    fixed = plan_report.fixed_from_overrides(ov, cfg)
    ts = []
    for _ in range(3):
        gc.collect(); gc.disable()
        t0 = time.process_time()
        plans = planner.plan_layouts(cfg, top=15, fixed=fixed)
        ts.append(time.process_time() - t0)
        gc.enable()
    d = plans[0]
    print(f"| {' '.join(ov)} | {statistics.median(ts):.2f} | {d['world_size']} | {d['degrees']} {d['schedule']} z{d['zero']} {d['recompute']} mb{d['micro_batch']} | {d['step_time_s']:.1f} | {d['mfu']:.3f} | {d['device_hours']:.3g} |")
