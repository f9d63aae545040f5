"""Benchmark: compile full GLM-5.2 plans, each in a fresh process, and print the figures.

Usage: python benchmarks/bench_compile.py [--out DIR]   (make bench-compile)
Per plan: trace time, pass time, in-process compile time, process wall time (includes
importing torch/vLLM), peak RSS, assignments, runs before/after coalescing, descriptor
lower bound, plan file size. The last line is a JSON array, one object per plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLANS = [
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16"},
    {"model": "glm-5.2", "trainer_format": "hf", "trainer_dtype": "bf16"},
    # The seed topology (issue: parallel layouts): targets 60 s wall, 4 GB RSS, 16 MB plan, src_balance <= 1.10.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep"},
    # The seed topology with vLLM's online fp8_per_block (issue 5): targets wire_bytes <= 1.05 x dst_bytes, 60 s.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep",
     "quant": "fp8_per_block"},
]


def worker(spec: dict, output: str) -> None:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    from weightplan.compiler.plan_summary import summarize
    from weightplan.runtime import load_plan

    result = compile_plan(CompileOptions(**spec, output=Path(output)))
    summary = summarize(load_plan(output))
    print(json.dumps({"timings": result.timings, "stats": result.stats, "plan_bytes": result.plan_bytes,
                      "src_balance": summary["src_balance"], "dst_balance": summary["dst_balance"],
                      "wire_bytes": summary["wire_bytes"], "dst_bytes": summary["dst_bytes"],
                      "sender_quantized_fraction": summary["sender_quantized_fraction"]}))


def run(spec: dict, out_dir: Path) -> dict:
    layouts = f"{spec.get('trainer', 'fsdp=1')} -> {spec.get('inference', 'tp=1')}"
    quant = spec.get("quant", "none")
    output = out_dir / (f"{spec['model']}-{spec['trainer_format']}-{spec['trainer_dtype']}-{layouts}-{quant}.plan".replace(" ", "").replace(">", ""))
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(spec), str(output)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"compile of {spec} failed with status {status}")
    r = json.loads(stdout.strip().splitlines()[-1])
    t, s = r["timings"], r["stats"]
    return {
        "plan": f"{spec['model']} {spec['trainer_format']}-{spec['trainer_dtype']} {layouts} {quant}",
        "compile_s": round(t["total"], 2),
        "wall_s": round(wall, 2),
        "build_s": round(t["build"], 2),
        "trace_s": round(t["trace"], 2),
        "write_s": round(t["write"], 2),
        "passes_s": round(t["passes"], 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "assignments": s["assignments"],
        "runs_before_coalesce": s["runs_before_coalesce"],
        "descriptors": s["descriptors"],
        "descriptors_lower_bound": s["descriptors_lower_bound"],
        "plan_bytes": r["plan_bytes"],
        "src_balance": round(r["src_balance"], 4),
        "dst_balance": round(r["dst_balance"], 4),
        "wire_over_dst": round(r["wire_bytes"] / r["dst_bytes"], 4),
        "sender_quantized_fraction": round(r["sender_quantized_fraction"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUTPUT"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker[0]), args.worker[1])
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench-compile-"))
    rows = []
    for spec in PLANS:
        row = run(spec, out_dir)
        rows.append(row)
        print(
            f"{row['plan']}: compile {row['compile_s']} s in-process (build {row['build_s']} s, trace {row['trace_s']} s, "
            f"passes {row['passes_s']} s, write {row['write_s']} s), "
            f"{row['wall_s']} s process wall incl. imports, peak RSS {row['peak_rss_mb']} MB; "
            f"{row['assignments']} assignments, {row['runs_before_coalesce']} runs -> {row['descriptors']} descriptors "
            f"(lower bound {row['descriptors_lower_bound']}); plan {row['plan_bytes']} bytes; "
            f"src_balance {row['src_balance']}, dst_balance {row['dst_balance']}",
            flush=True,
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
