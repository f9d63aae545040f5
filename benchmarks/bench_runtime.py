"""Benchmark: one weight sync between processes, against this machine's copy ceilings and the NCCL-style baseline.

Usage: python benchmarks/bench_runtime.py [--repeats N] [--quant fp8_per_block] [--strided-only] [--smoke]   (make bench-runtime)

A GLM-5.2-shaped model scaled to about 2 GB (benchmarks/configs/glm-5.2-2gb), bf16 masters,
2 trainer processes (FSDP=2) and 2 inference processes (vLLM models, DP attention + EP=2):
  (a)  memcpy of the same number of bytes inside one process;
  (a') process_vm_readv of every descriptor's bytes from the trainer processes (UCX's cma path), as a reader
       without packing would read them: from the trainers' own shards, cast where the wire dtype differs;
  (b)  our sync: publish, one-sided NIXL READs of all descriptors, sequence checks, acknowledgements;
  (c)  all-gather shards on the trainers, gloo broadcast of each full tensor from trainer 0,
       vLLM load_weights on each inference rank.
Bytes are destination bytes. Medians over repetitions after the first (which sets up connections).
Host overhead: publish + sync of synthetic plans with 10k and 100k small runs (128 B each),
minus their bytes at the ceiling rate.
tp-style case (benchmarks/synthetic_plans.py: tp_plan): 2 trainers (FSDP=2) and 2 tp ranks, 1.07 GB of
destination bytes, half in 1 KiB rows of strided runs (column slices), half in contiguous row slices: its
sync against its own process_vm_readv ceiling (one iovec per row), `strided_sync_vs_ceiling`, and the runtime
tables both sides built, `strided_table_bytes`, in the JSON line; then the same case with each
trainer serving its packed runs through a 64 MiB ring (`strided_ring_*`).
With --quant fp8_per_block, the same run then compiles the same model with --quant fp8_per_block
and times its sync (publish with sender-side quantization, READs, receiver-side quantization) in
the same processes layout, and prints seconds per GB of destination parameters next to the bf16
sync's, their ratio, and the sender- and receiver-side quantization times. It also prints the CPU
time the trainers' publishes used (process CPU time, every thread) divided by the cores this
process may run on: a floor for the fp8 sync on this host, since receivers wait for every publish.
--smoke runs every round on the smallest configuration (tests/configs/fp8-glm, a 4-matrix tp-style case, a 128 KiB
ring, 2 repetitions): tests/e2e/test_benchmark_smoke.py checks its JSON keys, never its figures.
The last line is one JSON object; `config` names the model config and `measured_at` when the run started (UTC).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from synthetic_plans import RUN_ELEMS, many_runs_plan, tp_plan

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Scale:
    """What one run moves: the model config of the GLM case, the tp-style case (tp_plan's sizes) and its ring."""

    config: Path
    strided: dict
    ring_bytes: int


# The tp-style case: 128 column-parallel matrices whose slices are 1024 rows of 1 KiB, as many row-parallel ones;
# then again through a ring: each trainer packs 268 MB in 4 chunks.
FULL = Scale(ROOT / "benchmarks" / "configs" / "glm-5.2-2gb", {"matrices": 128, "rows": 1024, "width": 512, "row_width": 1024},
             64 << 20)
# --smoke: a tiny GLM-5.2-shaped config whose blocks also quantize, 4 matrices of 64 rows, 4 ring chunks of 128 KiB.
SMOKE = Scale(ROOT / "tests" / "configs" / "fp8-glm", {"matrices": 4, "rows": 64, "width": 512, "row_width": 1024}, 128 << 10)
CONFIG = FULL.config


def memcpy_gbps(total: int, chunk: int = 256 << 20, repeats: int = 5) -> float:
    src, dst = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        left = total
        while left > 0:
            n = min(chunk, left)
            dst[:n].copy_(src[:n])
            left -= n
        times.append(time.perf_counter() - start)
    return total / statistics.median(times) / 1e9


def compile_bench_plan(out: Path, quant: str = "none", config: Path = CONFIG) -> Path:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    compile_plan(CompileOptions(str(config), "hf", "bf16", quant, out, trainer="fsdp=2", inference="dp=2,ep"))
    return out


def run_job(plan: Path, n_src: int, n_dst: int, repeats: int, job: str, *, model: Path | None, gloo: bool, tmp: Path,
            verify: bool = False, threads: int = 0, baseline: bool = True, ring_bytes: int = 0) -> list[dict]:
    """Run one trainer/inference job of runtime_bench_worker.py processes (inference ranks build `model`'s vLLM model
    if given) and return every JSON event they printed."""
    from weightplan.runtime import Rendezvous

    rendezvous = Rendezvous.connect(job, "127.0.0.1:0", serve=True, timeout=900)
    common = ["--plan", str(plan), "--address", rendezvous.address, "--job", job, "--repeats", str(repeats)]
    if gloo:
        common += ["--gloo"]
    if verify:
        common += ["--verify"]
    if threads:
        common += ["--threads", str(threads)]
    if not baseline:
        common += ["--no-baseline"]
    if ring_bytes:
        common += ["--ring-bytes", str(ring_bytes)]
    procs = []
    for role, n in (("trainer", n_src), ("inference", n_dst)):
        for rank in range(n):
            extra = ["--model", str(model)] if role == "inference" and model is not None else []
            out = open(tmp / f"{job}-{role}{rank}.out", "w")
            procs.append((subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "runtime_bench_worker.py"), role,
                                            "--rank", str(rank), *common, *extra], cwd=ROOT, stdout=out,
                                           stderr=open(tmp / f"{job}-{role}{rank}.err", "w")), out.name))
    if not gloo:
        keys = [f"bench/ready/trainer/{r}" for r in range(n_src)] + [f"bench/ready/inference/{k}" for k in range(n_dst)]
        rendezvous.wait(keys, 600, "benchmark workers")
        rendezvous.put("bench/start", b"1")
    events = []
    for proc, out in procs:
        if proc.wait(1800) != 0:
            for _, other in procs:
                if Path(other).with_suffix(".err").exists():
                    print(f"--- {Path(other).name}", *Path(other).with_suffix(".err").read_text().splitlines()[-15:], sep="\n")
            sys.exit(f"benchmark worker {Path(out).stem} exited with {proc.returncode}")
        events += [json.loads(line) for line in Path(out).read_text().splitlines() if line.startswith("{")]
    return events


def wall(events: list[dict], name: str, rep: int, start_role: str | None = None, end_role: str | None = None) -> float:
    rows = [e for e in events if e.get("round") == name and e["rep"] == rep]
    start = min(e["start"] for e in rows if start_role in (None, e["role"]))
    end = max(e["end"] for e in rows if end_role in (None, e["role"]))
    return end - start


def host_overhead(repeats: int, bytes_per_s: float, tmp: Path) -> dict[int, dict]:
    """Sync time of synthetic plans with many small descriptors, minus their bytes at `bytes_per_s`."""
    reps = range(2, repeats + 1)
    out = {}
    for n in (10_000, 100_000):
        synth = run_job(many_runs_plan(n, tmp / f"synthetic-{n}.plan"), 1, 1, repeats, f"overhead-{n}",
                        model=None, gloo=False, tmp=tmp)
        # Host work of one sync: the trainer's publish (including packing small runs) plus the receiver's sync.
        publish = {e["rep"]: e["published"] - e["start"] for e in synth if e.get("round") == "sync" and e["role"] == "trainer"}
        seconds = statistics.median(e["seconds"] + publish[e["rep"]] for e in synth
                                    if e.get("round") == "sync" and e["role"] == "inference" and e["rep"] > 1)
        readv = statistics.median(wall(synth, "ceiling", r) for r in reps)
        moved = n * RUN_ELEMS * 2
        out[n] = {"sync_s": seconds, "readv_s": readv, "overhead_ms": 1e3 * (seconds - moved / bytes_per_s)}
    return out


def strided_job(args, tmp: Path, ring_bytes: int = 0) -> dict:
    """The tp-style case: sync of args.scale.strided (half its bytes in 1 KiB rows of strided runs) against its readv
    ceiling; with `ring_bytes`, the trainers serve their packed runs through a ring of that size."""
    from weightplan.runtime import load_plan

    path = tp_plan(tmp / "bench-strided.plan", **args.scale.strided)
    plan = load_plan(path)
    # One torch thread per process, as in the fp8 job: four processes share this host's cores, and intra-op threads
    # of the trainers' packing copies then wait on each other (measured 20x slower under load).
    events = run_job(path, 2, 2, args.repeats, f"bench-runtime-strided-{ring_bytes}", model=None, gloo=True,
                     baseline=False, tmp=tmp, verify=args.verify, threads=args.strided_threads, ring_bytes=ring_bytes)
    reps = range(2, args.repeats + 1)
    syncs = [e for e in events if e.get("round") == "sync" and e["rep"] == 1]
    t = plan.table
    row_bytes = t["length"] * plan.stored_itemsize()
    holders = np.array([len(plan.dests[d].ranks) for d in t["dest"].tolist()])
    return {
        "bytes": sum(e["bytes"] for e in syncs if e["role"] == "inference"),
        "small_row_bytes": int((row_bytes * t["count"] * holders)[row_bytes <= 1024].sum()),
        "stored_runs": plan.n_stored_runs, "rows": plan.n_runs,
        "descriptors": sum(e["descriptors"] for e in syncs if e["role"] == "inference"),
        "table_bytes": sum(e["table_bytes"] for e in syncs),
        "packed_bytes": sum(e["packed_bytes"] for e in syncs if e["role"] == "trainer"),
        "ceiling": statistics.median(wall(events, "ceiling", r) for r in reps),
        "sync": statistics.median(wall(events, "sync", r, "trainer", "inference") for r in reps),
    }


def fp8_job(args, tmp: Path) -> dict:
    """Time fp8_per_block syncs of the same model: medians of reps 2..N, wall from the trainers' publish to the last receiver."""
    plan = compile_bench_plan(tmp / "bench-fp8.plan", "fp8_per_block", args.scale.config)
    events = run_job(plan, 2, 2, args.repeats, "bench-runtime-fp8", model=args.scale.config, gloo=True, tmp=tmp, verify=args.verify,
                     threads=args.fp8_threads)
    reps = range(2, args.repeats + 1)
    syncs = [e for e in events if e.get("round") == "sync"]

    def slowest(role: str, rep: int, key: str = "quantize_seconds") -> float:
        return max(e[key] for e in syncs if e["role"] == role and e["rep"] == rep)

    def summed(rep: int, key: str, role: str | None = None) -> float:
        return sum(e[key] for e in syncs if e["rep"] == rep and role in (None, e["role"]))

    joined = [e for e in events if e.get("event") == "joined"]
    return {
        "publish_cpu": statistics.median(summed(r, "publish_cpu_seconds", "trainer") for r in reps),
        "cpu": statistics.median(summed(r, "cpu_seconds") for r in reps),
        "bytes": sum(e["destination_bytes"] for e in syncs if e["role"] == "inference" and e["rep"] == 1),
        "wire_bytes": sum(e["bytes"] for e in syncs if e["role"] == "inference" and e["rep"] == 1),
        "descriptors": sum(e["descriptors"] for e in syncs if e["role"] == "inference" and e["rep"] == 1),
        "staging_bytes": max(e["staging_bytes"] for e in joined),
        "sync": statistics.median(wall(events, "sync", r, "trainer", "inference") for r in reps),
        "first": wall(events, "sync", 1, "trainer", "inference"),
        "sender_quantize": statistics.median(slowest("trainer", r) for r in reps),
        "receiver_quantize": statistics.median(slowest("inference", r) for r in reps),
        "sender_gather": statistics.median(slowest("trainer", r, "gather_seconds") for r in reps),
        "sender_publish": statistics.median(slowest("trainer", r, "published") - min(
            e["start"] for e in syncs if e["rep"] == r) for r in reps),
        "identical": [e["value"] for e in events if e.get("event") == "identical"],
    }


def strided_figures(strided: dict, ring: dict, ring_bytes: int, contiguous_gbps: float | None = None) -> dict:
    gb = strided["bytes"] / 1e9
    out = {"strided_bytes": strided["bytes"], "strided_small_row_bytes": strided["small_row_bytes"],
           "strided_sync_gbps": round(gb / strided["sync"], 3), "strided_ceiling_gbps": round(gb / strided["ceiling"], 3),
           "strided_sync_vs_ceiling": round(strided["ceiling"] / strided["sync"], 3),
           "strided_table_bytes": strided["table_bytes"], "strided_packed_bytes": strided["packed_bytes"],
           "strided_stored_runs": strided["stored_runs"], "strided_rows": strided["rows"],
           "strided_descriptors": strided["descriptors"],
           "strided_ring_bytes": ring_bytes, "strided_ring_sync_gbps": round(gb / ring["sync"], 3),
           "strided_ring_sync_vs_ceiling": round(ring["ceiling"] / ring["sync"], 3),
           "strided_ring_packed_bytes": ring["packed_bytes"]}
    if contiguous_gbps is not None:
        out["strided_vs_contiguous_sync"] = round(gb / strided["sync"] / contiguous_gbps, 3)
    return out


def print_strided(strided: dict, ring: dict, args) -> None:
    gb, repeats = strided["bytes"] / 1e9, args.repeats
    print(f"tp-style strided case ({args.scale.strided}), 2 trainer -> 2 inference processes (tp=2), bf16, {gb:.3f} GB destination "
          f"bytes, {strided['small_row_bytes'] / strided['bytes']:.0%} in rows <= 1 KiB; {strided['stored_runs']} stored runs "
          f"standing for {strided['rows']} rows, {strided['descriptors']} descriptors; medians of reps 2..{repeats}")
    print(f"  (a') process_vm_readv ceiling (one iovec per row) {gb / strided['ceiling']:7.2f} GB/s  {strided['ceiling']:.3f} s")
    print(f"  (b)  weightplan sync (publish packs, NIXL READ)   {gb / strided['sync']:7.2f} GB/s  {strided['sync']:.3f} s   "
          f"b / a' = {strided['ceiling'] / strided['sync']:.3f}")
    print(f"  runtime tables, both sides: {strided['table_bytes']} bytes; trainers' packed regions {strided['packed_bytes'] / 1e6:.1f} MB")
    print(f"  (b') the same through a {args.scale.ring_bytes / 2**20:g} MiB ring per trainer      {gb / ring['sync']:7.2f} GB/s  "
          f"{ring['sync']:.3f} s   b' / a' = {ring['ceiling'] / ring['sync']:.3f} (its own run's ceiling {gb / ring['ceiling']:.2f} GB/s); "
          f"rings {ring['packed_bytes'] / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="repetitions of every round (default 4; 2 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="the smallest configuration of every round: checks it runs, not its figures")
    parser.add_argument("--overhead-only", action="store_true", help="only the host-overhead rows (quick)")
    parser.add_argument("--strided-only", action="store_true", help="only the tp-style strided case")
    parser.add_argument("--strided-threads", type=int, default=1, help="torch threads per process in the strided case")
    parser.add_argument("--verify", action="store_true", help="syncs also hash and compare every region (measures its cost)")
    parser.add_argument("--quant", choices=("none", "fp8_per_block"), default="none",
                        help="also time an fp8_per_block sync of the same model in this run and compare per GB")
    parser.add_argument("--fp8-threads", type=int, default=1,
                        help="torch threads per process in the fp8 job (1: the 2 trainers quantize on one core each)")
    args = parser.parse_args()
    args.scale = SMOKE if args.smoke else FULL
    if args.repeats is None:
        args.repeats = 2 if args.smoke else 4
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: repetition 1 sets up connections and is not timed")
    measured_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    reps = range(2, args.repeats + 1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.overhead_only:
            rate = memcpy_gbps(1 << 30) * 1e9  # faster than the ceiling: overstates the overhead, never hides it
            for n, o in host_overhead(args.repeats, rate, tmp).items():
                print(f"host overhead, {n:>7,} descriptors: sync {o['sync_s'] * 1e3:.1f} ms, overhead {o['overhead_ms']:.1f} ms")
            return
        if args.strided_only:
            strided, ring = strided_job(args, tmp), strided_job(args, tmp, args.scale.ring_bytes)
            print_strided(strided, ring, args)
            print(json.dumps(strided_figures(strided, ring, args.scale.ring_bytes)))
            return
        plan = compile_bench_plan(tmp / "bench.plan", config=args.scale.config)
        events = run_job(plan, 2, 2, args.repeats, "bench-runtime", model=args.scale.config, gloo=True, tmp=tmp, verify=args.verify)
        syncs = [e for e in events if e.get("round") == "sync" and e["role"] == "inference"]
        nbytes = sum(e["bytes"] for e in syncs if e["rep"] == 1)
        descriptors = sum(e["descriptors"] for e in syncs if e["rep"] == 1)
        ceiling = statistics.median(wall(events, "ceiling", r) for r in reps)
        sync = statistics.median(wall(events, "sync", r, "trainer", "inference") for r in reps)
        sync_cpu = statistics.median(sum(e["cpu_seconds"] for e in events if e.get("round") == "sync" and e["rep"] == r)
                                     for r in reps)
        first_sync = wall(events, "sync", 1, "trainer", "inference")
        baseline = statistics.median(wall(events, "baseline", r) for r in reps)
        # Time inference ranks spent outside gloo calls during the baseline: vLLM's load_weights.
        loading = statistics.median(max(e["end"] - e["start"] - e["comm_s"] for e in events
                                        if e.get("round") == "baseline" and e["rep"] == r and e["role"] == "inference")
                                    for r in reps)
        identical = [e["value"] for e in events if e.get("event") == "identical"]
        memcpy = memcpy_gbps(nbytes)
        overhead = host_overhead(args.repeats, nbytes / ceiling, tmp)
        fp8 = fp8_job(args, tmp) if args.quant == "fp8_per_block" else None
        strided, ring = strided_job(args, tmp), strided_job(args, tmp, args.scale.ring_bytes)

    gb = nbytes / 1e9
    figures = {
        "config": str(args.scale.config.relative_to(ROOT)),
        "measured_at": measured_at,
        "repeats": args.repeats,
        "bytes": nbytes,
        "memcpy_gbps": round(memcpy, 3),
        "ceiling_gbps": round(gb / ceiling, 3),
        "sync_gbps": round(gb / sync, 3),
        "baseline_gbps": round(gb / baseline, 3),
        "sync_vs_ceiling": round(ceiling / sync, 3),
        "sync_vs_memcpy": round((gb / sync) / memcpy, 3),
        "speedup_vs_baseline": round(baseline / sync, 3),
        "host_overhead_ms_10k": round(overhead[10_000]["overhead_ms"], 2),
        "host_overhead_ms_100k": round(overhead[100_000]["overhead_ms"], 2),
        "verify": args.verify,
    }
    figures.update(strided_figures(strided, ring, args.scale.ring_bytes, gb / sync))
    cores = len(os.sched_getaffinity(0))
    figures["cores"] = cores
    figures["sync_cpu_busy"] = round(sync_cpu / (cores * sync), 3)
    if fp8 is not None:
        bf16_per_gb = sync / gb
        fp8_gb = fp8["bytes"] / 1e9
        # A lower bound on this host: receivers wait for every trainer's publish, whose CPU work
        # (staging, gathering, quantizing) cannot run faster than on all cores at once.
        floor = fp8["publish_cpu"] / cores / fp8_gb
        # An estimate, not a bound: add moving the fp8 bytes at the bf16 sync's rate (the same copies
        # by the same cores, which both syncs keep busy).
        estimate = floor + bf16_per_gb
        figures.update({
            "fp8_publish_cpu_s": round(fp8["publish_cpu"], 3), "fp8_sync_cpu_busy": round(fp8["cpu"] / (cores * fp8["sync"]), 3),
            "fp8_floor_s_per_gb": round(floor, 4), "fp8_floor_vs_bf16_per_gb": round(floor / bf16_per_gb, 3),
            "fp8_estimate_vs_bf16_per_gb": round(estimate / bf16_per_gb, 3),
            "fp8_bytes": fp8["bytes"], "fp8_wire_bytes": fp8["wire_bytes"], "fp8_sync_s": round(fp8["sync"], 3),
            "bf16_s_per_gb": round(bf16_per_gb, 4), "fp8_s_per_gb": round(fp8["sync"] / fp8_gb, 4),
            "fp8_vs_bf16_per_gb": round(fp8["sync"] / fp8_gb / bf16_per_gb, 3),
            # Derived, not measured alone: the sync minus the slowest trainer's quantization, per GB.
            "fp8_s_per_gb_without_sender_quantize": round((fp8["sync"] - fp8["sender_quantize"]) / fp8_gb, 4),
            "fp8_sender_quantize_s": round(fp8["sender_quantize"], 3),
            "fp8_sender_gather_s": round(fp8["sender_gather"], 3),
            "fp8_publish_s": round(fp8["sender_publish"], 3),
            "fp8_receiver_quantize_s": round(fp8["receiver_quantize"], 3),
            "fp8_identical": fp8["identical"],
        })
    print(f"GLM-5.2-shaped model ({args.scale.config.name}), 2 trainer -> 2 inference processes (dp=2,ep), bf16, "
          f"{gb:.3f} GB destination bytes in {descriptors} descriptors; medians of reps 2..{args.repeats}"
          + ("; per-sync verification on (trainers hash at publish, receivers after each group)" if args.verify else ""))
    print(f"  (a)  memcpy, one process            {memcpy:7.2f} GB/s")
    print(f"  (a') process_vm_readv ceiling       {gb / ceiling:7.2f} GB/s  {ceiling:.3f} s")
    print(f"  (b)  weightplan sync (NIXL READ)    {gb / sync:7.2f} GB/s  {sync:.3f} s   (first sync with connection set-up: {first_sync:.3f} s)")
    print(f"  (c)  all-gather + gloo bcast + load {gb / baseline:7.2f} GB/s  {baseline:.3f} s   "
          f"(of which outside gloo on the slowest inference rank, i.e. load_weights: {loading:.3f} s)")
    print(f"  b / a' = {figures['sync_vs_ceiling']:.3f}   b / a = {figures['sync_vs_memcpy']:.3f}   c / b time = {figures['speedup_vs_baseline']:.2f}x")
    print(f"  digests after our sync == after vLLM load_weights of the same weights: {identical}")
    print_strided(strided, ring, args)
    for n, o in overhead.items():
        print(f"  host overhead, {n:>7,} descriptors of {RUN_ELEMS * 2} B: sync {o['sync_s'] * 1e3:.1f} ms, "
              f"readv {o['readv_s'] * 1e3:.1f} ms, overhead {o['overhead_ms']:.1f} ms")
    if fp8 is not None:
        print(f"  fp8_per_block sync (same model, same processes layout, torch threads {args.fp8_threads or 'default'}): "
              f"{fp8['bytes'] / 1e9:.3f} GB destination ({fp8['wire_bytes'] / 1e9:.3f} GB read), {fp8['descriptors']} descriptors; "
              f"sync {fp8['sync']:.3f} s (first {fp8['first']:.3f} s)")
        print(f"    per GB of destination parameters: bf16 {figures['bf16_s_per_gb']:.4f} s/GB, fp8 {figures['fp8_s_per_gb']:.4f} s/GB, "
              f"fp8 / bf16 = {figures['fp8_vs_bf16_per_gb']:.3f} (target <= 1)")
        print(f"    CPU: the trainers' publishes used {fp8['publish_cpu']:.3f} CPU-s; spread over all {cores} cores that alone is "
              f"{figures['fp8_floor_s_per_gb']:.4f} s/GB, so fp8 / bf16 >= {figures['fp8_floor_vs_bf16_per_gb']:.3f} on this host; "
              f"plus moving the fp8 bytes at the bf16 sync's rate: fp8 / bf16 ~ {figures['fp8_estimate_vs_bf16_per_gb']:.3f}")
        print(f"    all processes together used {figures['fp8_sync_cpu_busy']:.0%} of the {cores} cores' time during the fp8 sync "
              f"({figures['sync_cpu_busy']:.0%} during the bf16 sync)")
        print(f"    without the sender-side quantization (sync - slowest trainer's quantize): "
              f"{figures['fp8_s_per_gb_without_sender_quantize']:.4f} s/GB")
        print(f"    sender-side quantize (publish, slowest trainer) {fp8['sender_quantize']:.3f} s; "
              f"receiver-side quantize (slowest inference rank) {fp8['receiver_quantize']:.3f} s; "
              f"receiver staging {fp8['staging_bytes'] / 1e6:.1f} MB")
        print(f"    publish (first trainer start to slowest trainer's version announced) {fp8['sender_publish']:.3f} s, "
              f"of which gathering peers' bf16 (slowest trainer) {fp8['sender_gather']:.3f} s")
        print(f"    digests after the fp8 sync == vLLM's own quantized load of the same weights: {fp8['identical']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
