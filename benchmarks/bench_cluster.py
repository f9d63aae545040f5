"""Benchmark (predictions, not measurements): the seed topology's sync time on the seed hardware, and the model's calibration.

Usage: python benchmarks/bench_cluster.py [--bench-output FILE | --measure] [--fanout-plan FILE] [--smoke]   (make bench-cluster)

Simulates the checked-in seed plans (GLM-5.2, stacked bf16 masters, fsdp=64,ep=8 -> tp1-dp32-ep,
bf16 and fp8_per_block), the checked-in pipelined plan of the same trainer -> tp=8,pp=2 (bf16; each
pipeline stage on an inference node of its own), and the fp8 seed plan with node-local fan-out (the same options with
--inference dp=32,ep,gpus-per-node=8, compiled here into a cache outside plans/, reused while the
compiler's sources, vLLM and the options are unchanged; --fanout-plan gives one compiled elsewhere)
on compiler/simulate/clusters/dgx-h200-seed.json with simulate-plan's model, prints the predicted
sync times, the bytes each inference NIC receives (max, mean; with fan-out the first hops, plus the
second hops each GPU reads over NVLink), the critical path, and the calibration errors of
benchmarks/calibrate_cluster.py (here: against a bench_runtime.py output: the newest saved one under
benchmarks/results, --bench-output FILE, or --measure to run it now; the line and the JSON say which
run and how old it is; published: against prime-rl's RDMA phase). The last line is one JSON object
with keys bf16_s, fp8_s, tp8_pp2_s, fp8_fanout_s, max_nic_gb, calibration_error_local, calibration_error_published,
calibration_source, calibration_measured_at and calibration_age_h (and a few more); fp8_fanout_delta_s is the fan-out
plan's delta sync at --delta-density (default: the fp8 density bench-delta measured at lr 1e-6) with the seed file's
assumed GPU encode and apply rates, fp8_fanout_delta_host_codec_s the same with the rates loopback.json holds for this
host's encoder and decoder (runtime/delta/kernels.py, one core; benchmarks/measure_delta_codec.py).
--smoke compiles a tiny fan-out plan (tests/configs/fp8-glm, fsdp=2 -> dp=4,ep,gpus-per-node=2) instead of
GLM-5.2's and needs --bench-output or --measure (it never falls back to a saved file): it checks that
everything runs, not the figures (tests/e2e/test_benchmark_smoke.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from calibrate_cluster import (PRIME_RL_RDMA_S, bench_figures, local_rows, measured_at, newest_bench_output, published,
                               run_bench)

ROOT = Path(__file__).resolve().parent.parent
SEED = str(ROOT / "plans" / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp1-dp32-ep__{}.plan")
TP8_PP2 = ROOT / "plans" / "glm-5.2" / "stacked-bf16-fsdp64-ep8__tp8-pp2__none.plan"
FANOUT_OPTIONS = {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "quant": "fp8_per_block",
                  "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep,gpus-per-node=8"}
FANOUT_TOKEN = "tp1-dp32-ep-node8"
# bench-delta's median density of the fp8 case at lr 1e-6 (docs/benchmark-results.md, run of 2026-12-03 10:00-10:43 UTC)
MEASURED_FP8_DENSITY = 0.01149
SMOKE_FANOUT = {"model": str(ROOT / "tests" / "configs" / "fp8-glm"), "trainer_format": "hf", "trainer_dtype": "bf16",
                "quant": "fp8_per_block", "trainer": "fsdp=2", "inference": "dp=4,ep,gpus-per-node=2"}
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
    return path, _compile(FANOUT_OPTIONS, path)


def _compile(options: dict, path: Path) -> float:
    """Compile a plan with these options to `path`; its seconds."""
    from weightplan.compiler.compile import CompileOptions, compile_plan

    start = time.perf_counter()
    compile_plan(CompileOptions(**options, output=path))
    return time.perf_counter() - start


def check_fanout_plan(plan, path: Path) -> None:
    """Exit with one line unless `plan` is the fp8 seed plan with gpus-per-node=8."""
    h = plan.header
    if (h.inference.token, h.trainer.token, h.quant, h.model) != (FANOUT_TOKEN, "fsdp64-ep8", "fp8_per_block", "glm-5.2"):
        raise SystemExit(f"error: {path} is not the fp8 seed plan with gpus-per-node=8 ({h.model}, {h.trainer.token} -> "
                         f"{h.inference.token}, {h.quant})")


def calibration_source(args) -> tuple[Path, str]:
    """The bench_runtime.py output the local calibration reads, and how to name it: run now, given, or the newest saved."""
    if args.measure:
        return run_bench(args.smoke), "measured now"
    if args.bench_output is not None:
        return args.bench_output, str(args.bench_output)
    path = newest_bench_output()
    return path, str(path.relative_to(ROOT))


def simulate(plan, cluster, label: str, delta=None, transfers=None) -> dict:
    """Predict one plan's sync (a delta sync with `delta`), print its lines, return simulate-plan's JSON figures."""
    from weightplan.compiler.simulate.model import predict
    from weightplan.compiler.simulate.transfers import plan_transfers

    prediction = predict(transfers or plan_transfers(plan), cluster, delta)
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
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bench-output", type=Path, help="saved bench_runtime.py output (default: newest under benchmarks/results)")
    source.add_argument("--measure", action="store_true", help="run benchmarks/bench_runtime.py now for the local calibration")
    parser.add_argument("--fanout-plan", type=Path, help="the fp8 seed plan compiled with gpus-per-node=8 (default: compile or reuse the cache)")
    parser.add_argument("--delta-density", type=float, default=MEASURED_FP8_DENSITY,
                        help=f"changed fraction of wire units for the delta sync (default {MEASURED_FP8_DENSITY}: bench-delta, fp8, lr 1e-6)")
    parser.add_argument("--smoke", action="store_true", help="a tiny fan-out plan (and bench_runtime.py --smoke with --measure): "
                                                              "checks it runs, not its figures")
    args = parser.parse_args()
    if args.smoke and args.fanout_plan:
        parser.error("--smoke compiles its own tiny fan-out plan: drop --fanout-plan")
    if args.smoke and not (args.bench_output or args.measure):
        parser.error("--smoke needs --bench-output FILE or --measure (a smoke run never reads a saved output)")
    from weightplan.compiler.simulate.delta import DeltaModelError, DeltaSync
    from weightplan.compiler.simulate.report import node_stages, resolve_cluster
    from weightplan.compiler.simulate.transfers import plan_transfers
    from weightplan.runtime import load_plan

    try:
        delta = DeltaSync(args.delta_density)
    except DeltaModelError as exc:
        parser.error(str(exc))

    cluster = resolve_cluster("dgx-h200-seed")
    bf16 = simulate(load_plan(SEED.format("none")), cluster, "bf16")
    fp8 = simulate(load_plan(SEED.format("fp8_per_block")), cluster, " fp8")
    pipelined = load_plan(TP8_PP2)
    tp8_pp2 = simulate(pipelined, cluster, "bf16 tp=8,pp=2")
    stages = node_stages(pipelined, cluster.nodes_of(pipelined.header.src_ranks, pipelined.header.dst_ranks)[1])
    print(" " * 6 + "bytes per inference node: " + ", ".join(f"{node} {n / 1e9:.3f} GB ({stages[node]})"
                                                            for node, n in tp8_pp2["inference_node_bytes"].items()))
    if args.smoke:
        path = Path(tempfile.mkdtemp(prefix="bench-cluster-smoke-")) / "fanout.plan"
        compile_s = _compile(SMOKE_FANOUT, path)
        fan_plan = load_plan(path)
    else:
        path, compile_s = fanout_plan(args.fanout_plan)
        fan_plan = load_plan(path)
        check_fanout_plan(fan_plan, path)
    print(f"fp8 + fan-out plan: {path} ({'compiled in %.1f s' % compile_s if compile_s is not None else 'reused, not compiled now'}; "
          f"{len(fan_plan.fanout.first_hops)} replicated entries pulled once per node of {fan_plan.fanout.gpus_per_node})")
    fan_transfers = plan_transfers(fan_plan)
    fan = simulate(fan_plan, cluster, " fp8 + fan-out", transfers=fan_transfers)
    fan_delta = simulate(fan_plan, cluster, f" fp8 + fan-out, delta at density {delta.density}", delta, fan_transfers)
    loopback = resolve_cluster("loopback")
    host_codec = dataclasses.replace(cluster, delta_encode_gbytes_per_s=loopback.delta_encode_gbytes_per_s,
                                     delta_apply_gbytes_per_s=loopback.delta_apply_gbytes_per_s)
    fan_delta_host = simulate(fan_plan, host_codec, " fp8 + fan-out, delta, this host's codec rates (loopback.json)", delta, fan_transfers)
    bench, source = calibration_source(args)
    figures = bench_figures(bench)
    when = measured_at(bench, figures)
    age_h = None if when is None else (datetime.now(timezone.utc) - when).total_seconds() / 3600
    local = local_rows(figures, ROOT / "compiler" / "simulate" / "clusters" / "loopback.json")[0]
    pub = published()
    print(f"calibration here uses the bench_runtime.py run in {source} ("
          + ("date unknown" if when is None else f"started {when:%Y-%m-%d %H:%M} UTC, {age_h:.1f} h ago")
          + f"; --measure runs it now): {local['plan']}: measured {local['measured_s']:.3f} s, predicted "
          f"{local['predicted_s']:.3f} s, error {local['error']:+.1%} (target within 25%)")
    print(f"calibration published (prime-rl RDMA phase {PRIME_RL_RDMA_S} s): predicted {pub['predicted_s']:.3f} s, "
          f"error {pub['error']:+.1%} (target within 15%)")
    print(json.dumps({
        "bf16_s": round(bf16["sync_s"], 4),
        "fp8_s": round(fp8["sync_s"], 4),
        "tp8_pp2_s": round(tp8_pp2["sync_s"], 4),
        "tp8_pp2_node_gb": {node: round(n / 1e9, 3) for node, n in tp8_pp2["inference_node_bytes"].items()},
        "fp8_fanout_s": round(fan["sync_s"], 4),
        "max_nic_gb": round(fp8["inference_nic_bytes"]["max"] / 1e9, 3),
        "mean_nic_gb": round(fp8["inference_nic_bytes"]["mean"] / 1e9, 3),
        "max_nic_gb_bf16": round(bf16["inference_nic_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_max_nic_gb": round(fan["inference_nic_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_mean_nic_gb": round(fan["inference_nic_bytes"]["mean"] / 1e9, 3),
        "fp8_fanout_second_hop_gb": round(fan["second_hop_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_critical_path": [s["phase"] for s in fan["critical_path"]],
        "fp8_fanout_delta_s": round(fan_delta["sync_s"], 4),
        "fp8_fanout_delta_density": delta.density,
        "fp8_fanout_delta_wire_ratio": round(fan_delta["delta"]["wire_ratio"], 4),
        "fp8_fanout_delta_max_nic_gb": round(fan_delta["inference_nic_bytes"]["max"] / 1e9, 3),
        "fp8_fanout_delta_critical_path": [s["phase"] for s in fan_delta["critical_path"]],
        "fp8_fanout_delta_host_codec_s": round(fan_delta_host["sync_s"], 4),
        "fp8_fanout_compile_s": None if compile_s is None else round(compile_s, 1),
        "calibration_error_local": round(local["error"], 4),
        "calibration_error_published": round(pub["error"], 4),
        "calibration_source": source,
        "calibration_measured_at": None if when is None else when.strftime("%Y-%m-%dT%H:%MZ"),
        "calibration_age_h": None if age_h is None else round(age_h, 1),
        "cluster": cluster.name,
    }))


if __name__ == "__main__":
    main()
