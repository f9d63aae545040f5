"""Benchmark (predictions, not measurements): the seed topology's sync time on the seed hardware, and the model's calibration.

Usage: python benchmarks/bench_cluster.py [--bench-output FILE] [--fanout-plan FILE]   (make bench-cluster)

Simulates the checked-in seed plans (GLM-5.2, stacked bf16 masters, fsdp=64,ep=8 -> tp1-dp32-ep,
bf16 and fp8_per_block) and the fp8 seed plan with node-local fan-out (the same options with
--inference dp=32,ep,gpus-per-node=8, compiled here into a cache outside plans/, reused while the
compiler's sources, vLLM and the options are unchanged; --fanout-plan gives one compiled elsewhere)
on compiler/simulate/clusters/dgx-h200-seed.json with simulate-plan's model, prints the predicted
sync times, the bytes each inference NIC receives (max, mean; with fan-out the first hops, plus the
second hops each GPU reads over NVLink), the critical path, and the calibration errors of
benchmarks/calibrate_cluster.py (here: against the saved bench_runtime.py output; published:
against prime-rl's RDMA phase). The last line is one JSON object with keys bf16_s, fp8_s,
fp8_fanout_s, max_nic_gb, calibration_error_local and calibration_error_published (and a few more).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from calibrate_cluster import PRIME_RL_RDMA_S, bench_figures, local_rows, newest_bench_output, published

ROOT = Path(__file__).resolve().parent.parent
SEED = str(ROOT / "plans" / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp1-dp32-ep__{}.plan")
FANOUT_OPTIONS = {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "quant": "fp8_per_block",
                  "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep,gpus-per-node=8"}
FANOUT_TOKEN = "tp1-dp32-ep-node8"
CACHE = Path(os.environ.get("WEIGHTPLAN_BENCH_CACHE", Path(tempfile.gettempdir()) / "weightplan-bench-cluster"))


def _cache_key() -> str:
    """What the fan-out plan's bytes depend on: the options, vLLM's version and every source file of weightplan."""
    import vllm

    digest = hashlib.sha256(json.dumps([FANOUT_OPTIONS, vllm.__version__], sort_keys=True).encode())
    for path in sorted(p for d in ("compiler", "runtime") for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".json")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def fanout_plan(given: Path | None) -> tuple[Path, float | None]:
    """The fp8 seed plan with gpus-per-node=8: `given`, a cached compile, or a fresh one; (path, compile seconds or None)."""
    if given is not None:
        return given, None
    path = CACHE / f"glm-5.2-fp8-node8-{_cache_key()}.plan"
    if path.is_file():
        return path, None
    from weightplan.compiler.compile import CompileOptions, compile_plan

    start = time.perf_counter()
    compile_plan(CompileOptions(**FANOUT_OPTIONS, output=path))
    return path, time.perf_counter() - start


def simulate(plan, cluster, label: str) -> dict:
    """Predict one plan's sync, print its lines, return simulate-plan's JSON figures."""
    from weightplan.compiler.simulate.model import predict
    from weightplan.compiler.simulate.transfers import plan_transfers

    prediction = predict(plan_transfers(plan), cluster)
    d = prediction.as_dict()
    nic, hop = d["inference_nic_bytes"], d.get("second_hop_bytes")
    print(f"{label}: predicted sync {prediction.sync_s:.3f} s on {cluster.name}; bytes per inference NIC max "
          f"{nic['max'] / 1e9:.3f} GB, mean {nic['mean'] / 1e9:.3f} GB" + (" (first hops)" if hop else "")
          + (f"; second hops per GPU max {hop['max'] / 1e9:.3f} GB, mean {hop['mean'] / 1e9:.3f} GB over NVLink" if hop else "")
          + f"; busiest NIC {d['busiest_nics'][0]['nic']} {d['busiest_nics'][0]['busy']:.3f} busy, mean NIC busy {d['nic_busy_mean']:.3f}")
    print(" " * 6 + "critical path: " + " -> ".join(f"{s['phase']} {s['task']} [{s['limited_by']}] {s['end_s'] - s['start_s']:.4f} s"
                                              for s in d["critical_path"]))
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-output", type=Path, help="saved bench_runtime.py output (default: newest under benchmarks/results)")
    parser.add_argument("--fanout-plan", type=Path, help="the fp8 seed plan compiled with gpus-per-node=8 (default: compile or reuse the cache)")
    args = parser.parse_args()
    from weightplan.compiler.simulate.report import resolve_cluster
    from weightplan.runtime import load_plan

    cluster = resolve_cluster("dgx-h200-seed")
    bf16 = simulate(load_plan(SEED.format("none")), cluster, "bf16")
    fp8 = simulate(load_plan(SEED.format("fp8_per_block")), cluster, " fp8")
    path, compile_s = fanout_plan(args.fanout_plan)
    fan_plan = load_plan(path)
    h = fan_plan.header
    if (h.inference.token, h.trainer.token, h.quant, h.model) != (FANOUT_TOKEN, "fsdp64-ep8", "fp8_per_block", "glm-5.2"):
        raise SystemExit(f"error: {path} is not the fp8 seed plan with gpus-per-node=8 ({h.model}, {h.trainer.token} -> "
                         f"{h.inference.token}, {h.quant})")
    print(f"fp8 + fan-out plan: {path} ({'compiled in %.1f s' % compile_s if compile_s is not None else 'reused, not compiled now'}; "
          f"{len(fan_plan.fanout.first_hops)} replicated entries pulled once per node of {fan_plan.fanout.gpus_per_node})")
    fan = simulate(fan_plan, cluster, " fp8 + fan-out")
    bench = args.bench_output or newest_bench_output()
    local = local_rows(bench_figures(bench), ROOT / "compiler" / "simulate" / "clusters" / "loopback.json")[0]
    pub = published()
    print(f"calibration here ({bench.name}, {local['plan']}): measured {local['measured_s']:.3f} s, predicted "
          f"{local['predicted_s']:.3f} s, error {local['error']:+.1%} (target within 25%)")
    print(f"calibration published (prime-rl RDMA phase {PRIME_RL_RDMA_S} s): predicted {pub['predicted_s']:.3f} s, "
          f"error {pub['error']:+.1%} (target within 15%)")
    print(json.dumps({
        "bf16_s": round(bf16["sync_s"], 4),
        "fp8_s": round(fp8["sync_s"], 4),
        "fp8_fanout_s": round(fan["sync_s"], 4),
        "max_nic_gb": round(fp8["inference_nic_bytes"]["max"] / 1e9, 3),
        "mean_nic_gb": round(fp8["inference_nic_bytes"]["mean"] / 1e9, 3),
        "max_nic_gb_bf16": round(bf16["inference_nic_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_max_nic_gb": round(fan["inference_nic_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_mean_nic_gb": round(fan["inference_nic_bytes"]["mean"] / 1e9, 3),
        "fp8_fanout_second_hop_gb": round(fan["second_hop_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_critical_path": [s["phase"] for s in fan["critical_path"]],
        "fp8_fanout_compile_s": None if compile_s is None else round(compile_s, 1),
        "calibration_error_local": round(local["error"], 4),
        "calibration_error_published": round(pub["error"], 4),
        "cluster": cluster.name,
    }))


if __name__ == "__main__":
    main()
