"""Calibration of simulate-plan: its predictions beside measured syncs here, and beside prime-rl's published RDMA phase.

Usage: python benchmarks/calibrate_cluster.py [--bench-output FILE | --run-bench] [--loopback FILE]

Here: the plans `make bench-runtime` runs (the plan of the config its output names, glm-5.2-2gb
unless --smoke, fsdp=2 -> dp=2,ep, and the synthetic plans of 10k and 100k runs of 128 B), compiled
again exactly as bench_runtime.py compiles them, simulated on the loopback cluster file, and printed beside the syncs that
bench_runtime.py measured (its saved output: --bench-output, default the newest
benchmarks/results/bench_runtime_*.txt; or --run-bench to run it now). The loopback "NIC" runs
at the process_vm_readv rate each inference process got in that same run (bench_runtime's (a')
ceiling, interleaved with the syncs: this machine is shared and its rates move with the load);
the per-descriptor cost comes from the loopback file (benchmarks/measure_loopback.py).

Published: the bf16 seed plan (plans/glm-5.2/stacked-bf16-fsdp64-ep8__tp1-dp32-ep__none.plan)
simulated on compiler/simulate/clusters/dgx-h200-seed.json, beside prime-rl's RDMA phase
(PR #3341: 1.864 s for 82.5 GB per inference GPU at 44.26 GB/s per NIC).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED_BF16 = ROOT / "plans" / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp1-dp32-ep__none.plan"
PRIME_RL_RDMA_S = 1.864  # prime-rl PR #3341, GLM-5.2 on 64 trainer + 32 inference H200: RDMA phase, median
PRIME_RL_GB_PER_GPU = 82.5
PRIME_RL_GBPS_PER_NIC = 44.26


def bench_figures(path: Path) -> dict:
    """The last JSON line of a bench_runtime.py output."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"error: {path} holds no bench_runtime.py JSON line")
    return json.loads(lines[-1])


def measured_at(path: Path, figures: dict) -> datetime | None:
    """When that bench_runtime.py run started (UTC): its `measured_at` key, else the first date (and time) of the
    file's comment header or name, as older saved outputs recorded it; None if neither says."""
    if "measured_at" in figures:
        return datetime.strptime(figures["measured_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    found = re.search(r"(\d{4}-\d{2}-\d{2})(?: (\d{2}:\d{2}))?", header) or re.search(r"(\d{4}-\d{2}-\d{2})()", path.name)
    if found is None:
        return None
    return datetime.strptime(f"{found[1]} {found[2] or '00:00'}", "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc)


def run_bench(smoke: bool = False) -> Path:
    """Run benchmarks/bench_runtime.py now (several minutes; --smoke: about a minute) and save its output to a temp file."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_runtime.py"), *(["--smoke"] if smoke else [])],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    path = Path(tempfile.mkstemp(prefix="bench_runtime_", suffix=".txt")[1])
    path.write_text(out)
    return path


def newest_bench_output() -> Path:
    found = sorted((ROOT / "benchmarks" / "results").glob("bench_runtime_*.txt"))
    if not found:
        sys.exit("error: no benchmarks/results/bench_runtime_*.txt; pass --bench-output FILE or --run-bench")
    return found[-1]


def local_rows(figures: dict, loopback: Path) -> list[dict]:
    """(plan, measured, predicted) for the bench plan and the synthetic plans of one bench_runtime.py run (its plan
    compiled again from the config it names; runs that predate the `config` key used glm-5.2-2gb)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_runtime import compile_bench_plan
    from synthetic_plans import RUN_ELEMS, many_runs_plan

    from weightplan.compiler.simulate.cluster import load_cluster
    from weightplan.compiler.simulate.model import predict
    from weightplan.compiler.simulate.transfers import plan_transfers
    from weightplan.runtime import load_plan

    base = load_cluster(loopback)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = ROOT / figures.get("config", "benchmarks/configs/glm-5.2-2gb")
        plan = load_plan(compile_bench_plan(tmp / "bench.plan", config=config))
        transfers = plan_transfers(plan)
        total = figures["bytes"]
        ceiling_s = total / 1e9 / figures["ceiling_gbps"]
        # The slowest reader sets the ceiling's wall time: that is the per-process rate in that run.
        rate = transfers.read_bytes.sum(axis=0).max() / ceiling_s
        cluster = dataclasses.replace(base, nic_gbytes_per_s=rate / 1e9, intra_node_gbytes_per_s=rate / 1e9)
        rows.append({"plan": f"{config.name} fsdp=2 -> dp=2,ep (bf16)", "measured_s": total / 1e9 / figures["sync_gbps"],
                     "predicted_s": predict(transfers, cluster).sync_s})
        for n in (10_000, 100_000):
            moved = n * RUN_ELEMS * 2
            # bench_runtime reports overhead = sync - moved / (bytes / ceiling): undo it.
            measured = figures[f"host_overhead_ms_{n // 1000}k"] / 1e3 + moved / (figures["ceiling_gbps"] * 1e9)
            synth = plan_transfers(load_plan(many_runs_plan(n, tmp / f"synthetic-{n}.plan")))
            rows.append({"plan": f"synthetic {n:,} runs of {RUN_ELEMS * 2} B", "measured_s": measured,
                         "predicted_s": predict(synth, cluster).sync_s})
        # A check of the model's form rather than of its inputs: the descriptor cost fitted on the 10k
        # plan of the same run, then the 100k plan predicted with it.
        ten = plan_transfers(load_plan(tmp / "synthetic-10000.plan"))
        bytes_s = predict(ten, dataclasses.replace(cluster, descriptor_us=0.0)).sync_s
        fitted = (rows[1]["measured_s"] - bytes_s) / 10_000 * 1e6
        hundred = plan_transfers(load_plan(tmp / "synthetic-100000.plan"))
        rows.append({"plan": f"synthetic 100,000 runs, {fitted:.3f} us/descriptor fitted on 10k", "measured_s": rows[2]["measured_s"],
                     "predicted_s": predict(hundred, dataclasses.replace(cluster, descriptor_us=fitted)).sync_s})
    for row in rows:
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
    rows[0]["nic_gbytes_per_s"] = rate / 1e9
    rows[0]["descriptor_us"] = base.descriptor_us
    return rows


def published() -> dict:
    """The bf16 seed plan on the seed hardware beside prime-rl's RDMA phase."""
    from weightplan.compiler.simulate.report import resolve_cluster
    from weightplan.compiler.simulate.model import predict
    from weightplan.compiler.simulate.transfers import plan_transfers
    from weightplan.runtime import load_plan

    prediction = predict(plan_transfers(load_plan(SEED_BF16)), resolve_cluster("dgx-h200-seed"))
    gb = float(prediction.inference_bytes.max()) / 1e9
    return {"predicted_s": prediction.sync_s, "measured_s": PRIME_RL_RDMA_S, "gb_per_gpu": gb,
            "error": prediction.sync_s / PRIME_RL_RDMA_S - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bench-output", type=Path, help="a saved bench_runtime.py output (default: newest under benchmarks/results)")
    source.add_argument("--run-bench", action="store_true", help="run benchmarks/bench_runtime.py now (several minutes)")
    parser.add_argument("--loopback", type=Path, default=ROOT / "compiler" / "simulate" / "clusters" / "loopback.json")
    args = parser.parse_args()
    path = run_bench() if args.run_bench else args.bench_output or newest_bench_output()
    rows = local_rows(bench_figures(path), args.loopback)
    pub = published()
    print(f"Here ({path.name}; loopback NIC {rows[0]['nic_gbytes_per_s']:.3f} GB/s per process = that run's process_vm_readv "
          f"ceiling, {rows[0]['descriptor_us']} us per descriptor from {args.loopback.name}):")
    print(f"  {'plan':<58} {'measured':>10} {'predicted':>10} {'error':>8}")
    for r in rows:
        print(f"  {r['plan']:<58} {r['measured_s']:>9.4f}s {r['predicted_s']:>9.4f}s {r['error']:>+8.1%}")
    print(f"Published (prime-rl PR #3341, RDMA phase of GLM-5.2's weight update, {PRIME_RL_GB_PER_GPU} GB per GPU at "
          f"{PRIME_RL_GBPS_PER_NIC} GB/s per NIC):")
    print(f"  bf16 seed plan ({pub['gb_per_gpu']:.2f} GB per inference GPU) on dgx-h200-seed: predicted {pub['predicted_s']:.3f} s, "
          f"measured {PRIME_RL_RDMA_S} s, error {pub['error']:+.1%}")
    print(json.dumps({"calibration_error_local": round(rows[0]["error"], 4),
                      "calibration_error_synthetic_10k": round(rows[1]["error"], 4),
                      "calibration_error_synthetic_100k": round(rows[2]["error"], 4),
                      "calibration_error_synthetic_100k_fitted_on_10k": round(rows[3]["error"], 4),
                      "calibration_error_published": round(pub["error"], 4),
                      "bench_output": path.name}))


if __name__ == "__main__":
    main()
