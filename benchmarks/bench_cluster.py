"""Benchmark (predictions, not measurements): the seed topology's sync time on the seed hardware, and the model's calibration.

Usage: python benchmarks/bench_cluster.py [--bench-output FILE]   (make bench-cluster)

Simulates the checked-in seed plans (GLM-5.2, stacked bf16 masters, fsdp=64,ep=8 -> tp1-dp32-ep,
bf16 and fp8_per_block) on compiler/simulate/clusters/dgx-h200-seed.json with simulate-plan's
model, prints the predicted sync times, the bytes each inference NIC receives (max, mean), the
critical path, and the calibration errors of benchmarks/calibrate_cluster.py (here: against the
saved bench_runtime.py output; published: against prime-rl's RDMA phase). The last line is one
JSON object with keys bf16_s, fp8_s, fp8_fanout_s, max_nic_gb, calibration_error_local and
calibration_error_published (and a few more).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from calibrate_cluster import PRIME_RL_RDMA_S, bench_figures, local_rows, newest_bench_output, published

ROOT = Path(__file__).resolve().parent.parent
SEED = str(ROOT / "plans" / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp1-dp32-ep__{}.plan")
FANOUT_REASON = ("node-local fan-out (issue 19, first half) is not built yet: the compiler has no "
                 "--inference gpus-per-node and the runtime no inference-to-inference reads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-output", type=Path, help="saved bench_runtime.py output (default: newest under benchmarks/results)")
    args = parser.parse_args()
    from weightplan.compiler.simulate.model import predict
    from weightplan.compiler.simulate.report import resolve_cluster
    from weightplan.compiler.simulate.transfers import plan_transfers
    from weightplan.runtime import load_plan

    cluster = resolve_cluster("dgx-h200-seed")
    results = {}
    for quant in ("none", "fp8_per_block"):
        prediction = predict(plan_transfers(load_plan(SEED.format(quant))), cluster)
        d = prediction.as_dict()
        results[quant] = (prediction, d)
        label = "bf16" if quant == "none" else "fp8"
        nic = d["inference_nic_bytes"]
        print(f"{label:>4}: predicted sync {prediction.sync_s:.3f} s on {cluster.name}; bytes per inference NIC max "
              f"{nic['max'] / 1e9:.3f} GB, mean {nic['mean'] / 1e9:.3f} GB; busiest NIC {d['busiest_nics'][0]['nic']} "
              f"{d['busiest_nics'][0]['busy']:.3f} busy, mean NIC busy {d['nic_busy_mean']:.3f}")
        print("      critical path: " + " -> ".join(f"{s['phase']} {s['task']} [{s['limited_by']}] {s['end_s'] - s['start_s']:.4f} s"
                                              for s in d["critical_path"]))
    print(f"fp8 + fan-out: not predicted ({FANOUT_REASON})")
    bench = args.bench_output or newest_bench_output()
    local = local_rows(bench_figures(bench), ROOT / "compiler" / "simulate" / "clusters" / "loopback.json")[0]
    pub = published()
    print(f"calibration here ({bench.name}, {local['plan']}): measured {local['measured_s']:.3f} s, predicted "
          f"{local['predicted_s']:.3f} s, error {local['error']:+.1%} (target within 25%)")
    print(f"calibration published (prime-rl RDMA phase {PRIME_RL_RDMA_S} s): predicted {pub['predicted_s']:.3f} s, "
          f"error {pub['error']:+.1%} (target within 15%)")
    bf16, fp8 = results["none"][1], results["fp8_per_block"][1]
    print(json.dumps({
        "bf16_s": round(bf16["sync_s"], 4),
        "fp8_s": round(fp8["sync_s"], 4),
        "fp8_fanout_s": None,
        "fp8_fanout_reason": FANOUT_REASON,
        "max_nic_gb": round(fp8["inference_nic_bytes"]["max"] / 1e9, 3),
        "mean_nic_gb": round(fp8["inference_nic_bytes"]["mean"] / 1e9, 3),
        "max_nic_gb_bf16": round(bf16["inference_nic_bytes"]["max"] / 1e9, 3),
        "calibration_error_local": round(local["error"], 4),
        "calibration_error_published": round(pub["error"], 4),
        "cluster": cluster.name,
    }))


if __name__ == "__main__":
    main()
